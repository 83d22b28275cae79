"""compressed-tensors checkpoints in the `pack-quantized` format (`quant_method:
compressed-tensors`; llm-compressor).

Each of `config_groups` gives its `targets` (a class name such as "Linear", a module name,
or "re:<regex>" matched from the start of the name) a weight scheme `{num_bits, type: int,
symmetric, strategy: group | channel, group_size}`; `ignore` lists layers left in float.
Per linear layer W `[N, K]` with b-bit codes (p = 32 / b per int32): `weight_packed`
int32 `[N, K / p]` of the signed codes plus 2**(b-1), packed along the input dim lowest
bits first; `weight_scale` float `[N, G]` (G = 1 per channel); asymmetric layers add
`weight_zero_point` int32 `[ceil(N / p), G]`, the signed zero points plus 2**(b-1) packed
along the output dim (older writers: signed, unpacked, `[N, G]`); `weight_shape` `[2]` = [N, K]; `weight_g_idx` `[K]` with activation
ordering "group". W = (code - zero) * scale, which the common offset leaves unchanged.

The `float-quantized` format (weights `type: float`, 8 bits: fp8 e4m3; strategies tensor,
channel, group and block with `block_structure` [rows, columns]) stores `weight` and
`weight_scale` as `sprig.runtime.quantization.formats.fp8` reads them; its activation
schemes are accepted and the activations run unquantized (see that module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from sprig.runtime.quantization.formats.base import expect, packed_count, unpack_int32
from sprig.runtime.quantization.formats.fp8 import float8_leaves, float8_pieces, float8_scheme
from sprig.runtime.quantization.weight import QuantScheme

LAYER_CLASS = "Linear"  # the class name targets use for every linear layer
FORMATS = ("pack-quantized", "float-quantized")
STRATEGIES = ("group", "channel")
FLOAT_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class CompressedTensorsFormat:
    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]  # (targets, scheme), in order
    ignore: tuple[str, ...] = ()
    name: str = "compressed-tensors"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> CompressedTensorsFormat:
        fmt = cfg.get("format")
        if cfg.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors kv_cache_scheme is not supported")
        groups = []
        for name, group in (cfg.get("config_groups") or {}).items():
            group_format = group.get("format") or fmt
            if group_format not in FORMATS:
                raise ValueError(
                    f"compressed-tensors format {group_format!r} (group {name}) is not supported; "
                    f"supported: {', '.join(FORMATS)}"
                )
            activations = group.get("input_activations") or group.get("output_activations")
            if activations and group_format != "float-quantized":
                raise ValueError(
                    f"compressed-tensors activation quantization (group {name}) is not supported"
                )
            scheme = _scheme(name, group.get("weights") or {})
            if scheme.float8 != (group_format == "float-quantized"):
                raise ValueError(f"compressed-tensors group {name}: {group_format} stores "
                                 f"{'float' if group_format == 'float-quantized' else 'int'} weights")
            groups.append((tuple(group.get("targets") or ()), scheme))
        if not groups:
            raise ValueError("compressed-tensors config has no config_groups")
        return cls(tuple(groups), tuple(cfg.get("ignore") or ()))

    def scheme_for(self, module: str) -> QuantScheme | None:
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == LAYER_CLASS or _matches(t, module) for t in targets):
                return scheme
        return None

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        if scheme.float8:
            return float8_leaves("weight_scale")
        required = {"weight_packed", "weight_scale", "weight_shape"}
        if not scheme.symmetric:
            required.add("weight_zero_point")
        return frozenset(required), frozenset({"weight_g_idx"})

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        if scheme.float8:
            return float8_pieces(leaf, tensor, scheme, rows, cols)
        groups = scheme.num_groups(cols)
        if leaf == "weight_packed":
            expect(tensor, leaf, (rows, packed_count(cols, scheme.bits, leaf)), torch.int32)
            pieces = {"qweight": unpack_int32(tensor, scheme.bits, 1).to(torch.uint8)}
            if scheme.symmetric:
                pieces["zeros"] = torch.full((rows, groups), float(scheme.mid))
            return pieces
        if leaf == "weight_scale":
            expect(tensor, leaf, (rows, groups))
            return {"scales": tensor.float()}
        if leaf == "weight_zero_point":
            if tuple(tensor.shape) == (rows, groups):  # older writers: signed, unpacked
                return {"zeros": tensor.float() + scheme.mid}
            words = -(-rows // (32 // scheme.bits))
            expect(tensor, leaf, (words, groups), torch.int32)
            return {"zeros": unpack_int32(tensor, scheme.bits, 0)[:rows].float()}
        if leaf == "weight_shape":
            if tensor.tolist() != [rows, cols]:
                raise ValueError(f"weight_shape is {tensor.tolist()}, the layer is {[rows, cols]}")
            return {}
        expect(tensor, leaf, (cols,))
        return {"g_idx": tensor.long()}


def _scheme(name: str, weights: dict[str, Any]) -> QuantScheme:
    kind = weights.get("type", "int")
    if kind == "float":
        return _float_scheme(name, weights)
    if kind != "int":
        raise ValueError(f"compressed-tensors weight type {kind!r} (group {name}) is not supported")
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(
            f"compressed-tensors strategy {strategy!r} (group {name}) is not supported; "
            f"supported: {', '.join(STRATEGIES)}"
        )
    group = weights.get("group_size") if strategy == "group" else None
    return QuantScheme(weights.get("num_bits", 8), group, weights.get("symmetric", True))


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _float_scheme(name: str, weights: dict[str, Any]) -> QuantScheme:
    if weights.get("num_bits", 8) != 8:
        raise ValueError(f"compressed-tensors float weights of {weights['num_bits']} bits (group {name}) "
                         "are not supported (8: fp8 e4m3)")
    strategy = weights.get("strategy")
    if strategy not in FLOAT_STRATEGIES:
        raise ValueError(
            f"compressed-tensors strategy {strategy!r} for float weights (group {name}) is not supported; "
            f"supported: {', '.join(FLOAT_STRATEGIES)}"
        )
    if strategy == "block":
        return float8_scheme(weights.get("block_structure"), f"compressed-tensors group {name} block_structure")
    return QuantScheme(8, weights.get("group_size") if strategy == "group" else None, float8=True)
