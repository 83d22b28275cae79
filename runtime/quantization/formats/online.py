"""Online quantization of a float checkpoint: each linear layer's `weight` is quantized
round-to-nearest (`quantize_rtn`) as it loads, so the float weights never all sit in memory.

`--quantization int8`: 8-bit codes, one scale per output channel, symmetric.
`--quantization int4`: 4-bit codes, a scale and a zero point per group of `group_size`
inputs (asymmetric: all 16 codes span each group's range; on the demo model symmetric int4
lost 7 points of accuracy where this loses 1).
`--quantization fp8`: float8 e4m3 codes, one scale per output channel (max|w| / 448).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.runtime.quantization.formats.base import expect
from sprig.runtime.quantization.online_schemes import check_online_scheme
from sprig.runtime.quantization.weight import QuantScheme, quantize_rtn

SCHEMES = {  # name -> scheme, given the group size (which only int4 uses); keys: online_schemes.ONLINE_SCHEMES
    "int8": lambda group_size: QuantScheme(8),
    "int4": lambda group_size: QuantScheme(4, group_size, symmetric=False),
    "fp8": lambda group_size: QuantScheme(8, float8=True),
}


@dataclass(frozen=True)
class OnlineFormat:
    scheme: QuantScheme
    name: str

    @classmethod
    def of(cls, name: str, group_size: int) -> OnlineFormat:
        """The online scheme `name` ("int8", "int4" or "fp8"); `group_size` applies to int4."""
        check_online_scheme(name, group_size)
        scheme = SCHEMES[name](group_size)
        return cls(scheme, name)

    def scheme_for(self, module: str) -> QuantScheme | None:
        return self.scheme

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"weight"}), frozenset()

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        expect(tensor, leaf, (rows, cols))
        weight = quantize_rtn(tensor, scheme)
        return {"qweight": weight.qweight, "scales": weight.scales, "zeros": weight.zeros}
