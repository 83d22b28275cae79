"""Checkpoints a training step would write: the same model with other weights, written
with safetensors beside a copy of every other file (config, tokenizer)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]


def edited_copy(src: Path, dst: Path, edit: Callable[[Tensors], Tensors]) -> Path:
    """`src` at `dst` with its weights replaced by `edit(weights)` (one safetensors file)."""
    dst.mkdir(parents=True, exist_ok=True)
    weights: Tensors = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            weights |= load_file(str(f))
        elif f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in edit(weights).items()}, str(dst / "model.safetensors"))
    return dst


def perturbed_copy(src: Path, dst: Path, *, seed: int, scale: float = 0.05,
                   dtype: torch.dtype | None = None) -> Path:
    """`src` with seeded Gaussian noise of std `scale` added to every weight (a step of
    training), stored in `dtype` if given."""
    gen = torch.Generator().manual_seed(seed)

    def perturb(weights: Tensors) -> Tensors:
        out = {}
        for name in sorted(weights):
            w = weights[name].float()
            w = w + torch.randn(w.shape, generator=gen) * scale
            out[name] = w.to(dtype or weights[name].dtype)
        return out

    return edited_copy(src, dst, perturb)
