"""RMSNorm with an optional fused residual add, in three conventions.

Hugging Face `LlamaRMSNorm`: y = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype) * weight.
OLMo's (`round_once`): y = (x_f32 * rsqrt(mean(x_f32^2) + eps) * weight_f32).to(x.dtype).
Gemma's (`unit_offset`, which implies `round_once`): the same with 1 + weight_f32.
The last two are rounded once, in x's dtype whatever the weight's.
With a residual: s = x + residual (in x.dtype), y = norm(s), returns (y, s).
"""

from __future__ import annotations

import torch

from ._dispatch import next_pow2, use_triton
from ._triton import tl, triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] (read when HAS_RESIDUAL)
    w_ptr,  # [H]
    y_ptr,  # [T, H]
    sum_ptr,  # [T, H] (written when HAS_RESIDUAL)
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_ONCE: tl.constexpr,  # scale by the weight in float32, round once (OLMo's, Gemma's)
    UNIT_OFFSET: tl.constexpr,  # scale by 1 + weight (Gemma's)
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    # all arithmetic in float32 with explicit rounding to the input dtype where torch rounds
    # (bit-compatible with torch's half-precision ops, and safe in the CPU interpreter)
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    h = h * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = 1.0 + w
    if not ROUND_ONCE:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (h * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    *,
    unit_offset: bool = False,
    round_once: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher: one program per row."""
    round_once = round_once or unit_offset
    shape = x.shape
    H = shape[-1]
    x2 = x.reshape(-1, H).contiguous()  # [T, H]
    T = x2.shape[0]
    out_dtype = x.dtype if round_once else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((T, H), dtype=out_dtype, device=x.device)
    s = torch.empty_like(x2) if residual is not None else x2
    r = residual.reshape(-1, H).contiguous() if residual is not None else x2
    if T > 0:
        _rms_norm_kernel[(T,)](
            x2, r, weight.contiguous(), y, s, H, eps,
            HAS_RESIDUAL=residual is not None, ROUND_ONCE=round_once, UNIT_OFFSET=unit_offset,
            BLOCK_H=next_pow2(H),
        )
    if residual is None:
        return y.view(shape)
    return y.view(shape), s.view(shape)


def rms_norm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    *,
    unit_offset: bool = False,
    round_once: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference, bit-identical to HF `LlamaRMSNorm` (float32 math, cast, then * weight),
    with `round_once` to OLMo's (float32 math * weight, then cast), with `unit_offset` to
    Gemma's (float32 math * (1 + weight), then cast)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # a new tensor: x is kept
    if unit_offset or round_once:
        y = h.mul_(weight.float() + 1.0 if unit_offset else weight.float()).to(x.dtype)
        return y if residual is None else (y, x)
    y = h.to(x.dtype)
    y = y.mul_(weight) if weight.dtype == y.dtype else weight * y  # in place on a temporary
    return y if residual is None else (y, x)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    *,
    unit_offset: bool = False,
    round_once: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (OLMo's with `round_once`, Gemma's with `unit_offset`); returns y, or
    (y, x + residual) when a residual is given."""
    if use_triton(x, weight, residual):
        return rms_norm_triton(x, weight, eps, residual, unit_offset=unit_offset, round_once=round_once)
    return rms_norm_ref(x, weight, eps, residual, unit_offset=unit_offset, round_once=round_once)
