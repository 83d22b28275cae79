"""FP8 checkpoints: float8 e4m3 weights with float32 scales (`quant_method: fp8`, as
written by transformers' fine-grained FP8, DeepSeek and the older per-tensor writers),
and the tensors compressed-tensors' `float-quantized` format stores the same way.

Per linear layer W `[N, K]`: `weight` float8_e4m3fn `[N, K]`, and its scale:
`weight_scale` per tensor (`[]` or `[1]`), per output channel (`[N, 1]`) or per group of
columns (`[N, K / group]`, compressed-tensors), or, scaled per
block of bn x bk (`weight_block_size` [bn, bk]), `weight_scale_inv` `[ceil(N / bn),
ceil(K / bk)]` (despite its name, W = weight * weight_scale_inv, block-wise); `input_scale`
(static activation scales) may be present. W = float32(weight) * scale.

Activations are not quantized: a checkpoint made for fp8 activations (static or dynamic)
runs with its fp8 weights and activations in the model's dtype, which is at least as
accurate; the weights take half the bytes of bfloat16 ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sprig.runtime.quantization.formats.base import expect
from sprig.runtime.quantization.weight import FLOAT8, QuantScheme

ACTIVATION_SCHEMES = ("dynamic", "static")


def float8_scheme(block: list[int] | tuple[int, ...] | None, where: str) -> QuantScheme:
    """The scheme of fp8 weights scaled per tensor or channel (`block` None) or per block
    [rows, columns]; ValueError naming `where` for a malformed block."""
    if block is None:
        return QuantScheme(8, None, float8=True)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"{where}: a weight block is [rows, columns] of positive integers, got {block!r}")
    return QuantScheme(8, block[1], float8=True, block_rows=block[0])


def float8_leaves(scale: str) -> tuple[frozenset[str], frozenset[str]]:
    """(required, optional) tensors of an fp8 layer whose scale is stored as `scale`."""
    return frozenset({"weight", scale}), frozenset({"input_scale"})


def float8_pieces(leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """The canonical pieces of one fp8 checkpoint tensor of a shard `[rows, cols]`: the
    weight, the activations' scale (not used), or the weight's scale (any other leaf)."""
    groups = scheme.num_groups(cols)
    if leaf == "weight":
        expect(tensor, leaf, (rows, cols), FLOAT8)
        return {"qweight": tensor.view(torch.uint8), "zeros": torch.zeros(rows, groups)}
    if leaf == "input_scale":
        return {}
    if scheme.block_rows is not None:
        bn = scheme.block_rows
        expect(tensor, leaf, (math.ceil(rows / bn), groups))
        return {"scales": tensor.float().repeat_interleave(bn, 0)[:rows].contiguous()}
    if tensor.numel() == 1:  # per tensor
        return {"scales": tensor.float().reshape(1, 1).expand(rows, groups).contiguous()}
    if tuple(tensor.shape) == (rows,) and groups == 1:
        tensor = tensor[:, None]
    expect(tensor, leaf, (rows, groups))  # per channel, or per group of columns
    return {"scales": tensor.float()}


@dataclass(frozen=True)
class Fp8Format:
    scheme: QuantScheme
    ignored: tuple[str, ...] = ()
    name: str = "fp8"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Fp8Format:
        activations = cfg.get("activation_scheme", "dynamic")
        if activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme {activations!r} is not supported; supported: dynamic, static")
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 fmt {fmt!r} is not supported (e4m3 is)")
        ignored = tuple(cfg.get("ignored_layers") or ()) + tuple(cfg.get("modules_to_not_convert") or ())
        return cls(float8_scheme(cfg.get("weight_block_size"), "fp8 weight_block_size"), ignored)

    def scheme_for(self, module: str) -> QuantScheme | None:
        if module.endswith("lm_head") or any(module == i or module.endswith("." + i) for i in self.ignored):
            return None
        return self.scheme

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        return float8_leaves("weight_scale_inv" if scheme.block_rows is not None else "weight_scale")

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        return float8_pieces(leaf, tensor, scheme, rows, cols)
