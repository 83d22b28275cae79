"""GPTQ checkpoints (`quant_method: gptq`; AutoGPTQ, GPTQModel, optimum).

Per linear layer W `[N, K]` with b-bit codes (b = 4 or 8, p = 32 / b codes per int32):
`qweight` int32 `[K / p, N]` packed along the input dim (code of input k in word k // p
at bits (k % p) * b), `qzeros` int32 `[G, N / p]` packed the same way along the output
dim, `scales` float `[G, N]`, `g_idx` int32 `[K]` (the group of each input; not monotone
in act-order, `desc_act`, checkpoints). `checkpoint_format` "gptq" (the default, v1)
stores each zero point minus one; "gptq_v2" stores it as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sprig.runtime.quantization.formats.base import expect, packed_count, unpack_int32
from sprig.runtime.quantization.weight import QuantScheme

ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what loading adds to qzeros


@dataclass(frozen=True)
class GPTQFormat:
    scheme: QuantScheme
    zero_offset: int
    name: str = "gptq"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> GPTQFormat:
        bits = cfg.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with bits={bits} is not supported (4 and 8 are)")
        checkpoint_format = cfg.get("checkpoint_format") or "gptq"
        if checkpoint_format not in ZERO_OFFSETS:
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; supported: "
                f"{', '.join(ZERO_OFFSETS)}"
            )
        if cfg.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported")
        if cfg.get("dynamic"):
            raise ValueError("GPTQ per-module 'dynamic' overrides are not supported")
        group = cfg.get("group_size", -1)
        scheme = QuantScheme(bits, None if group in (-1, None) else group, cfg.get("sym", True))
        return cls(scheme, ZERO_OFFSETS[checkpoint_format])

    def scheme_for(self, module: str) -> QuantScheme | None:
        return self.scheme

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"qweight", "qzeros", "scales"}), frozenset({"g_idx"})

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        groups = scheme.num_groups(cols)
        if leaf == "qweight":
            expect(tensor, leaf, (packed_count(cols, scheme.bits, leaf), rows), torch.int32)
            return {"qweight": unpack_int32(tensor, scheme.bits, 0).T.to(torch.uint8)}
        if leaf == "qzeros":
            expect(tensor, leaf, (groups, packed_count(rows, scheme.bits, leaf)), torch.int32)
            zeros = unpack_int32(tensor, scheme.bits, 1) + self.zero_offset
            return {"zeros": zeros.T.float()}
        if leaf == "scales":
            expect(tensor, leaf, (groups, rows))
            return {"scales": tensor.T.float()}
        expect(tensor, leaf, (cols,))
        return {"g_idx": tensor.long()}
