"""The canonical quantized weight every format loads into, its plain dequantization, and
round-to-nearest (RTN) quantization of a float weight.

A quantized linear weight W `[N, K]` (N output rows, K input columns) is stored as
unsigned integer codes `q [N, K]` of `bits` bits, and per (row, group of input columns) a
float scale and an integer zero point:

    W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

with g(k) = k // group_size, or g_idx[k] for checkpoints quantized in activation order
(GPTQ `desc_act`), whose groups are not runs of adjacent columns. Per-output-channel
quantization is the case of one group per row (group_size == K).

FP8 weights (`float8`) store the bits of float8 e4m3 values as the codes and no zero
point: W[n, k] = float32(e4m3(q[n, k])) * scales[n, g(k)]. A per-tensor scale is the same
scale on every row; a block-wise one (blocks of rows x `group_size` columns) is each
row's copy of its block's.

The form slices like a float weight: rows (a column-parallel split) keep every field's
meaning, and columns split at group boundaries (a row-parallel split) do too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

QUANT_BITS = (4, 8)
FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(FLOAT8).max)  # 448


@dataclass(frozen=True)
class QuantScheme:
    """How one linear layer's weight is quantized: `bits` per code, `group_size` input
    columns per scale (None: one scale per output row), whether the zero point is fixed
    at 2**(bits-1) (`symmetric`) or stored per group, and whether the codes are float8
    e4m3 values (`float8`: 8 bits, symmetric, no zero point) rather than integers, scaled
    (as a checkpoint stores them) per block of `block_rows` rows when given."""

    bits: int
    group_size: int | None = None
    symmetric: bool = True
    float8: bool = False
    block_rows: int | None = None  # float8 checkpoints scaled per block: the block's rows

    def __post_init__(self) -> None:
        if self.bits not in QUANT_BITS:
            raise ValueError(f"quantized weights need bits in {QUANT_BITS}, got {self.bits}")
        if self.float8 and (self.bits != 8 or not self.symmetric):
            raise ValueError("float8 weights are 8 bits with no zero point (symmetric)")
        if self.block_rows is not None and (not self.float8 or self.group_size is None or self.block_rows <= 0):
            raise ValueError("block_rows applies to float8 weights scaled per block of rows x group_size columns")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive (or None: per channel), got {self.group_size}")

    def num_groups(self, in_features: int) -> int:
        """Groups per row for a layer with `in_features` inputs; ValueError if they do not tile it."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"quantization group size {self.group_size} does not divide in_features {in_features}"
            )
        return in_features // self.group_size

    @property
    def mid(self) -> int:
        """The symmetric zero point, 2**(bits-1)."""
        return 1 << (self.bits - 1)


@dataclass(frozen=True)
class QuantizedWeight:
    """W `[N, K]` as codes, scales and zero points (see the module docstring).

    Invariants: `qweight` uint8 `[N, K]` with codes < 2**bits (with `float8`, the bits
    of e4m3 values); `scales` and `zeros` float32 `[N, G]` with G dividing K (zeros hold
    integers; 0 with `float8`); `g_idx` None (column k is in group k // (K // G)) or int64
    `[K]` with values < G.
    """

    qweight: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor  # [N, G] float32
    bits: int
    g_idx: torch.Tensor | None = None  # [K] int64
    float8: bool = False

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def column_groups(self) -> torch.Tensor:  # [K] int64
        """The group of every input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        """The float weight the codes stand for: the plain reference every kernel matches."""
        g = self.column_groups()
        if self.float8:
            return self.qweight.view(FLOAT8).float() * self.scales[:, g]
        return (self.qweight.float() - self.zeros[:, g]) * self.scales[:, g]

    def with_adjacent_groups(self) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """This weight with its columns reordered so that every group is a run of
        `group_size` adjacent columns, and the order `perm` `[K]` (None when already so):
        `x[:, perm] @ W'.T == x @ W.T`. ValueError if some group is not exactly
        `group_size` columns (no packed kernel could run such a layout)."""
        if self.g_idx is None:
            return self, None
        plain = torch.arange(self.in_features) // self.group_size
        if torch.equal(self.g_idx.cpu(), plain):
            return replace(self, g_idx=None), None
        perm = torch.argsort(self.g_idx.cpu(), stable=True)
        if not torch.equal(self.g_idx.cpu()[perm], plain):
            raise ValueError(
                f"g_idx does not put exactly {self.group_size} input columns in each group"
            )
        perm = perm.to(self.qweight.device)
        return replace(self, qweight=self.qweight[:, perm].contiguous(), g_idx=None), perm


def quantize_rtn(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight `[N, K]`, each (row, group) scaled
    by its own range. Symmetric: scale = max|w| / (2**(bits-1) - 1), zero 2**(bits-1).
    Asymmetric: the range [min(w, 0), max(w, 0)] maps onto the codes 0 .. 2**bits - 1.
    Float8: scale = max|w| / 448, the codes w / scale rounded to the nearest e4m3 value."""
    if scheme.float8:
        return quantize_float8(weight, scheme.group_size)
    n, k = weight.shape
    groups = scheme.num_groups(k)
    w = weight.detach().float().reshape(n, groups, k // groups)  # [N, G, K/G]
    top = (1 << scheme.bits) - 1
    if scheme.symmetric:
        scales = w.abs().amax(-1) / (scheme.mid - 1)  # [N, G]
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.full_like(scales, float(scheme.mid))
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = (high - low) / top
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = torch.round(-low / scales).clamp(0, top)
    codes = torch.round(w / scales[..., None]) + zeros[..., None]
    qweight = codes.clamp(0, top).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(qweight, scales, zeros, scheme.bits)


def quantize_float8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """float8 e4m3 codes of a float weight `[N, K]`, each (row, group) scaled so its largest
    magnitude is e4m3's largest value, 448 (rounding to nearest even)."""
    n, k = weight.shape
    groups = QuantScheme(8, group_size, float8=True).num_groups(k)
    w = weight.detach().float().reshape(n, groups, k // groups)  # [N, G, K/G]
    scales = w.abs().amax(-1) / FLOAT8_MAX  # [N, G]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / scales[..., None]).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return QuantizedWeight(codes.reshape(n, k).view(torch.uint8), scales, torch.zeros_like(scales), 8, float8=True)
