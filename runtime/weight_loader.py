"""Build a model without initialising it, then fill every parameter from the checkpoint's
safetensors files (one file, or all the shards an index names).

Checked: every parameter (every shard of a fused one) is loaded exactly once, and every
checkpoint tensor lands somewhere; a missing, unexpected, duplicated or mis-shaped
tensor is a ValueError naming the file and the tensor. So no uninitialised memory
survives loading.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sprig.runtime.layers.linear import MergedLinear
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import model_class

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints saved
INDEX_FILE = "model.safetensors.index.json"

Target = tuple[str, str | None]  # (sprig parameter name, shard of a MergedLinear or None)


def load_model(
    config: ModelConfig, path: str | Path, *, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The registered model for `config`, in `dtype` on `device`, weights from `path`.

    Parameters are allocated uninitialised (built on the meta device, then `to_empty`);
    modules with derived buffers recompute them through `reset_buffers()`.
    """
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    model.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
    load_weights(model, path)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return model.eval()


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files to read: those an index names, else every `*.safetensors`."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index}: names shard {f.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (other weight formats are not supported)")
    return files


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter of `model`."""
    params = dict(model.named_parameters())
    expected = _expected_targets(model)
    packed: dict[str, tuple[str, str]] = model.packed_modules
    tied = model.config.tie_word_embeddings
    loaded: dict[Target, Path] = {}  # -> the file it came from
    for file, name, handle in _tensors(path):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target = _target(name, packed)
        if target not in expected:
            raise ValueError(f"{file}: unexpected tensor {name!r} (no such parameter in the model)")
        if target in loaded:
            raise ValueError(f"{file}: tensor {name!r} also in {loaded[target]}")
        dest = _destination(model, params, target)
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(dest.shape):
            raise ValueError(
                f"{file}: tensor {name!r} has shape {list(shape)}, the model expects {list(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(handle.get_tensor(name))
        loaded[target] = file
    missing = sorted(expected - loaded.keys(), key=str)
    if missing:
        names = ", ".join(_hf_name(t, packed) for t in missing)
        raise ValueError(f"{Path(path)}: checkpoint is missing tensor(s) {names}")


def _tensors(path: str | Path) -> Iterator[tuple[Path, str, Any]]:
    """(file, tensor name, open handle) for every tensor in every checkpoint file."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                yield file, name, handle


def _expected_targets(model: nn.Module) -> set[Target]:
    targets: set[Target] = set()
    for name, _ in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, MergedLinear):
            targets.update((name, shard) for shard in owner.out_sizes)
        else:
            targets.add((name, None))
    return targets


def _target(hf_name: str, packed: dict[str, tuple[str, str]]) -> Target:
    """HF tensor name -> sprig parameter and shard, e.g. `...self_attn.k_proj.weight` ->
    (`...self_attn.qkv_proj.weight`, "k")."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            fused, shard = packed[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return hf_name, None


def _hf_name(target: Target, packed: dict[str, tuple[str, str]]) -> str:
    """Inverse of `_target`: the checkpoint name a missing target would have had."""
    name, shard = target
    if shard is None:
        return name
    hf_part = {v: k for k, v in packed.items()}[(name.split(".")[-2], shard)]
    module, _, leaf = name.rpartition(".")
    return f"{module.rpartition('.')[0]}.{hf_part}.{leaf}"


def _destination(model: nn.Module, params: dict[str, nn.Parameter], target: Target) -> torch.Tensor:
    name, shard = target
    param = params[name]
    if shard is None:
        return param.data
    owner = model.get_submodule(name.rpartition(".")[0])
    return param.data[owner.shard_rows(shard)]
