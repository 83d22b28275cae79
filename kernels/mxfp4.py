"""OCP MXFP4 weights as gpt-oss checkpoints store them, and their exact dequantization.

A weight [..., N, K] is held as FP4 e2m1 codes, two to a byte, and one e8m0 scale per 32
consecutive k. Code c (4 bits) is sign (bit 3) and magnitude E2M1[c & 7]; scale byte s is
2 ** (s - 127). Element k of a row lies in byte k // 2 of its row, the low nibble for even
k. Every MXFP4 value is exact in float32 and bfloat16 (the torch reference dequantizes to
those without rounding; float16's narrower range may round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # consecutive k sharing one scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between E2M1[i] and E2M1[i + 1]


@dataclass(frozen=True)
class Mxfp4Weight:
    """Stacked experts' weights [E, N, K] in OCP MXFP4, as gpt-oss checkpoints store them:
    blocks uint8 [E, N, K // 32, 16] (two FP4 e2m1 codes per byte, the low nibble first, i.e.
    element 2j in the low nibble of byte j), scales uint8 [E, N, K // 32] (e8m0: each group of
    32 consecutive k is scaled by 2 ** (s - 127)). Both live on the same device."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise TypeError(f"MXFP4 blocks and scales are uint8, not {b.dtype} and {s.dtype}")
        if b.dim() != 4 or b.shape[-1] != GROUP // 2 or tuple(s.shape) != tuple(b.shape[:-1]):
            raise ValueError(f"MXFP4 blocks [E, N, K/32, 16] and scales [E, N, K/32], not "
                             f"{tuple(b.shape)} and {tuple(s.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the weight these codes stand for."""
        E, N, groups, _ = self.blocks.shape
        return E, N, groups * GROUP


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K // 32, 16] uint8 + [..., N, K // 32] uint8 -> [..., N, K] in dtype (exact for
    bf16/fp32). Computed in float32, where every code times its scale is exact."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()  # [..., N, K/32, 32]
    values = torch.ldexp(table[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (blocks, scales): round-to-nearest (ties to the even code) onto the
    e2m1 grid with a power-of-two scale per 32 k, the smallest that fits the group's largest
    |w| (<= 6 * scale), clamped to the e8m0 range 2 ** -127 .. 2 ** 127 (values past
    6 * 2 ** 127 saturate to +-6 * scale). Values that round to zero get code +0.

    For tests and for building tiny checkpoints. dequantize(quantize(w)) is w's nearest MXFP4
    value at that scale; quantize(dequantize(b, s)) == (b, s) for codes without -0 in groups
    whose largest magnitude code is 4 or 6 (a smaller maximum makes a smaller scale fit)."""
    *lead, K = w.shape
    if K % GROUP:
        raise ValueError(f"K = {K} is not a multiple of {GROUP}")
    groups = w.float().reshape(*lead, K // GROUP, GROUP)
    mantissa, exponent = torch.frexp(groups.abs().amax(dim=-1))  # amax = mantissa * 2 ** exponent
    # smallest e with amax <= 6 * 2 ** e: 8 * mantissa is in [4, 8), so e = exponent - 3 or - 2
    e = exponent - 3 + (mantissa > 0.75).to(exponent.dtype)
    e = torch.where(mantissa == 0, 0, e).clamp(-127, 127)
    scaled = torch.ldexp(groups.abs(), -e[..., None]).clamp(max=6.0)  # [..., N, K/32, 32]
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    up_on_tie = torch.arange(len(_MIDPOINTS), device=w.device) % 2 == 1  # the upper code is even
    magnitude = ((scaled[..., None] > mids) | ((scaled[..., None] == mids) & up_on_tie)).sum(-1)
    codes = (magnitude | ((groups < 0) & (magnitude > 0)).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4  # [..., N, K/32, 16]
    return blocks, (e + 127).to(torch.uint8)
