"""Quantized KV pools: each token's K (and V) of each KV head, D values, is stored as int8
(or float8 e4m3) with one float16 scale beside it.

The rule, followed by every path so that every path sees the same dequantized cache:

    scale = float16(min(max|x| / QMAX, 65504)), stored as 1 where that is 0
    int8:     q = clamp(x / scale, -127, 127), rounded half away from zero
    fp8_e4m3: q = float8_e4m3fn(clamp(x / scale, -448, 448)), rounded to nearest even
    dequantized x = (float32(q) * float32(scale)) in the model's dtype

QMAX is the storage type's largest value (127, 448); x is the K or V row in float32 and
the divisions are IEEE float32. float32(q) * float32(scale) is exact (at most 8 + 11
significant bits), so a float32 model's attention reads exactly the dequantized values on
every path. The torch functions here are the reference; the Triton helpers are the same
arithmetic for the store and attention kernels.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton

SCALE_DTYPE = torch.float16
SCALE_MAX = 65504.0  # float16's largest finite value: a larger scale is clamped to it


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a pool buffer of this dtype holds quantized values (int8, float8 e4m3)."""
    return dtype in (torch.int8, torch.float8_e4m3fn)


def qmax(dtype: torch.dtype) -> float:
    """The largest value of a quantized storage type: 127 for int8, 448 for float8 e4m3."""
    if not is_quantized(dtype):
        raise ValueError(f"{dtype} is not a quantized KV storage type")
    info = torch.iinfo(dtype) if not dtype.is_floating_point else torch.finfo(dtype)
    return float(info.max)


def kernel_scales(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    k_scale: torch.Tensor | None,  # [S, Hkv]
    v_scale: torch.Tensor | None,  # [S, Hkv]
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What a kernel receives for a pool's scales: `(k_scale, v_scale, True)` for a
    quantized pool, checked (both given, `[S, Hkv]` float16, contiguous); for a float pool
    none may be given, and the buffers stand in for them, never read: `(k_buffer,
    v_buffer, False)`."""
    quantized = is_quantized(k_buffer.dtype)
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(f"a {k_buffer.dtype} pool takes scales exactly when it is quantized")
    if not quantized:
        return k_buffer, v_buffer, False
    for s in (k_scale, v_scale):
        if s.dtype != SCALE_DTYPE or s.shape != k_buffer.shape[:2] or not s.is_contiguous():
            raise ValueError(f"scales must be contiguous [S, Hkv] {SCALE_DTYPE}, got {s.dtype} {tuple(s.shape)}")
    return k_scale, v_scale, True


def quantize_kv_ref(
    x: torch.Tensor,  # [..., D]
    dtype: torch.dtype,  # int8 or float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., D] dtype, [...] float16
    """Each row of `x` quantized by the module's rule, and its scale."""
    limit = qmax(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1).div_(limit).clamp_(max=SCALE_MAX).to(SCALE_DTYPE)  # [...]
    scale.masked_fill_(scale == 0, 1.0)
    y = (x / scale.float().unsqueeze(-1)).clamp_(-limit, limit)
    if not dtype.is_floating_point:  # half away from zero; the cast truncates
        y.add_(y.sign().mul_(0.5))
    return y.to(dtype), scale


def dequantize_kv_ref(
    q: torch.Tensor,  # [..., D] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [...] float16
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., D] dtype
    """The values attention reads from quantized rows `q` with their `scale`s."""
    return q.float().mul_(scale.float().unsqueeze(-1)).to(dtype)


@triton.jit
def quantize_tile(
    x,  # [BH, BD] float32, masked entries 0: one row per (token, KV head)
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,  # integer storage: round half away from zero (the cast truncates)
):
    """`quantize_kv_ref` of each row of `x`: returns its values (float32, integral when
    ROUND, still to be cast to the storage type) and its scales `[BH]` float16."""
    amax = tl.max(tl.abs(x), 1)  # [BH]
    scale = tl.minimum(tl.math.div_rn(amax, QMAX), 65504.0).to(tl.float16)
    scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if ROUND:
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
    return y, scale


@triton.jit
def dequantize_tile(
    q,  # [BN, BD] int8 or float8 e4m3
    scale,  # [BN] float16 (or float32)
    dtype: tl.constexpr,  # the model's dtype
):
    """`dequantize_kv_ref` of each row of `q`."""
    return (q.to(tl.float32) * scale.to(tl.float32)[:, None]).to(dtype)
