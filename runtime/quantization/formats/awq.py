"""AWQ checkpoints in the GEMM layout (`quant_method: awq`, `version: gemm`; AutoAWQ).

Per linear layer W `[N, K]` with 4-bit codes: `qweight` int32 `[K, N / 8]` packed along
the output dim in AWQ's interleaved order (word j, nibble i holds output
8 j + PACK_ORDER[i]), `qzeros` int32 `[G, N / 8]` packed the same way (zero points as
they are), `scales` float `[G, N]`. Layers named in `modules_to_not_convert` (matched as
substrings of the module name) stay in float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sprig.runtime.quantization.formats.base import expect, packed_count, unpack_int32
from sprig.runtime.quantization.weight import QuantScheme

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output PACK_ORDER[i]


@dataclass(frozen=True)
class AWQFormat:
    scheme: QuantScheme
    not_converted: tuple[str, ...] = ()
    name: str = "awq"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> AWQFormat:
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the 'gemm' layout is)")
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported (4 is)")
        if not cfg.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        group = cfg.get("group_size", cfg.get("q_group_size", -1))
        scheme = QuantScheme(4, None if group in (-1, None) else group, symmetric=False)
        return cls(scheme, tuple(cfg.get("modules_to_not_convert") or ()))

    def scheme_for(self, module: str) -> QuantScheme | None:
        return None if any(part in module for part in self.not_converted) else self.scheme

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"qweight", "qzeros", "scales"}), frozenset()

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        if leaf == "scales":
            expect(tensor, leaf, (scheme.num_groups(cols), rows))
            return {"scales": tensor.T.float()}
        height = cols if leaf == "qweight" else scheme.num_groups(cols)
        expect(tensor, leaf, (height, packed_count(rows, 4, leaf)), torch.int32)
        codes = _unscramble(unpack_int32(tensor, 4, 1))  # [height, rows]
        if leaf == "qweight":
            return {"qweight": codes.T.to(torch.uint8)}
        return {"zeros": codes.T.float()}


def _unscramble(codes: torch.Tensor) -> torch.Tensor:  # [R, C] in packed order -> output order
    words = codes.reshape(codes.shape[0], -1, 8)
    out = torch.empty_like(words)
    out[..., list(PACK_ORDER)] = words
    return out.reshape(codes.shape)
