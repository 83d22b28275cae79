"""The ways a quantized weight is multiplied, each built from a `QuantizedWeight` whose
groups are adjacent columns, and a registry that picks one per device.

- `Int8PerChannelCPU`: torch's `_weight_int8pack_mm` (int8 codes, one scale per row);
  an asymmetric zero point is subtracted as `rowsum(x) * scale * (zero - 128)`.
- `Int4CPU`: torch's `_convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu`,
  which compute `W = (q - 8) * scale + offset` per group of 32/64/128/256 columns, so the
  offset is `(8 - zero) * scale`; rows are padded to a multiple of 16.
- `Float8CPU`: float8 e4m3 weights kept in 8 bits, widened to the activations' dtype for
  each call's dense matmul (a scale per output applied to the product; group or block
  scales to the weight, in float32). The widening costs far more than the matmul on a CPU
  (torch has no vectorised float8 conversion): fp8 on a CPU saves memory, not time.
- `DequantMatmul`: `sprig.kernels.quant_matmul` (Triton on CUDA, decoding integer or
  float8 codes in the kernel; on CPU its plain dequantize-then-matmul reference): any
  bits, any group size.

Every one computes `x @ W.T` in x's dtype (the model's) and keeps no state between calls.
On CPU the torch kernels are vectorised for bfloat16 and float16 activations; with float32
activations they are exact but take a scalar path.
"""

from __future__ import annotations

import torch
from torch import nn

from sprig.kernels import pack_codes, quant_matmul
from sprig.runtime.quantization.weight import FLOAT8, QuantizedWeight

CPU_INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
CPU_INT4_ROWS = 16  # it needs the output rows in multiples of this


class Int8PerChannelCPU(nn.Module):
    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        return weight.bits == 8 and weight.scales.shape[1] == 1 and not weight.float8

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        codes = (weight.qweight.to(torch.int16) - 128).to(torch.int8)
        self.register_buffer("codes", codes.to(device))  # [N, K] int8
        self.register_buffer("scales", weight.scales[:, 0].to(dtype).to(device))  # [N]
        offset = weight.zeros[:, 0] - 128  # [N]: zero in the signed codes' terms
        self.register_buffer(
            "zero_scales", (offset * weight.scales[:, 0]).to(dtype).to(device) if offset.any() else None
        )  # [N] or None when symmetric

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        if self.zero_scales is not None:
            y = y - x.sum(-1, keepdim=True) * self.zero_scales
        return y


class Int4CPU(nn.Module):
    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        return weight.bits == 4 and _cpu_int4_group(weight.group_size) is not None and not weight.float8

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        group = _cpu_int4_group(weight.group_size)
        assert group is not None
        repeat = weight.group_size // group  # a larger group is several equal smaller ones
        n = weight.out_features
        pad = -n % CPU_INT4_ROWS
        self.out_features, self.group = n, group
        codes = nn.functional.pad(weight.qweight.to(torch.int32), (0, 0, 0, pad))  # [N', K]
        scales = weight.scales.repeat_interleave(repeat, 1)  # [N, K / group]
        offsets = (8 - weight.zeros.repeat_interleave(repeat, 1)) * scales
        packed_sz = nn.functional.pad(torch.stack([scales, offsets], -1), (0, 0, 0, 0, 0, pad))
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).to(device)
        )  # [N', K / 2] uint8
        self.register_buffer(
            "scales_and_offsets", packed_sz.transpose(0, 1).contiguous().to(dtype).to(device)
        )  # [K / group, N', 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, self.group, self.scales_and_offsets
        )
        return y if y.shape[1] == self.out_features else y[:, : self.out_features].contiguous()


class DequantMatmul(nn.Module):
    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        return weight.in_features % (8 // weight.bits) == 0

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.bits, self.float8 = weight.bits, weight.float8
        self.register_buffer("qweight", pack_codes(weight.qweight.T, weight.bits).to(device))  # [K b/8, N]
        self.register_buffer("scales", weight.scales.T.contiguous().to(device))  # [G, N] float32
        self.register_buffer("zeros", weight.zeros.T.contiguous().to(device))  # [G, N] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        return quant_matmul(x, self.qweight, self.scales, self.zeros, bits=self.bits, float8=self.float8)


class Float8CPU(nn.Module):
    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        return weight.float8

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("codes", weight.qweight.view(FLOAT8).to(device))  # [N, K] float8 e4m3
        self.register_buffer("scales", weight.scales.to(device))  # [N, G] float32
        self.group = weight.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.scales.shape[1] == 1:  # one scale per output: applied to the product
            return nn.functional.linear(x, self.codes.to(x.dtype)) * self.scales[:, 0].to(x.dtype)
        scales = self.scales.repeat_interleave(self.group, 1)
        return nn.functional.linear(x, (self.codes.float() * scales).to(x.dtype))


# device type -> candidates, the first that supports a weight wins
MATMULS: dict[str, tuple[type[nn.Module], ...]] = {
    "cpu": (Float8CPU, Int8PerChannelCPU, Int4CPU, DequantMatmul),
    "cuda": (DequantMatmul,),
}


def build_matmul(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The first of `MATMULS[device.type]` that runs `weight` (groups must be adjacent)."""
    assert weight.g_idx is None, "reorder act-order columns first (with_adjacent_groups)"
    for cls in MATMULS[device.type]:
        if cls.supports(weight):
            return cls(weight, dtype, device)
    raise ValueError(
        f"no quantized matmul for a {weight.bits}-bit weight with {weight.in_features} inputs on {device}"
    )


def _cpu_int4_group(group_size: int) -> int | None:
    return next((g for g in CPU_INT4_GROUPS if group_size % g == 0), None)
