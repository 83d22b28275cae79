"""Scatter new tokens' K/V into the paged KV pool: buffer[loc[i]] = new[i]; into a
quantized pool (int8 or float8 e4m3 buffers with float16 scales `[S, Hkv]` beside them)
each (token, KV head) row is quantized on the way in (`kv_quant`)."""

from __future__ import annotations

import torch

from ._dispatch import next_pow2, use_triton
from ._triton import tl, triton
from .kv_quant import kernel_scales, qmax, quantize_kv_ref, quantize_tile


@triton.jit
def _store_kv_kernel(
    k_buf_ptr,  # [S, Hkv*D] rows contiguous
    v_buf_ptr,  # [S, Hkv*D]
    k_scale_ptr,  # [S, Hkv] float16, contiguous (read when QUANT)
    v_scale_ptr,  # [S, Hkv]
    loc_ptr,  # [n]
    k_ptr,  # [n, Hkv*D]
    v_ptr,  # [n, Hkv*D]
    num_heads,  # Hkv
    stride_kb,
    stride_vb,
    stride_k,
    stride_v,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,  # quantize each (token, head) row into the storage type
    QMAX: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One program: token i, BLOCK_H of its KV heads."""
    i = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    d = tl.arange(0, BLOCK_D)  # [BD]
    mask = (heads < num_heads)[:, None] & (d < D)[None, :]
    offs = heads[:, None] * D + d[None, :]  # [BH, BD]
    slot = tl.load(loc_ptr + i).to(tl.int64)
    k = tl.load(k_ptr + i * stride_k + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + i * stride_v + offs, mask=mask, other=0.0)
    if QUANT:
        k, k_scale = quantize_tile(k.to(tl.float32), QMAX, ROUND)
        v, v_scale = quantize_tile(v.to(tl.float32), QMAX, ROUND)
        tl.store(k_scale_ptr + slot * num_heads + heads, k_scale, mask=heads < num_heads)
        tl.store(v_scale_ptr + slot * num_heads + heads, v_scale, mask=heads < num_heads)
    tl.store(k_buf_ptr + slot * stride_kb + offs, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * stride_vb + offs, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:  # [m, H, D] -> [m, H*D] with unit inner stride
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv_triton(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
    *,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: given exactly for a quantized pool
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
) -> None:
    """Triton launcher: grid (tokens, blocks of KV heads). Buffers must have contiguous rows."""
    n = loc.shape[0]
    k_scale_arg, v_scale_arg, quantized = kernel_scales(k_buffer, v_buffer, k_scale, v_scale)
    if n == 0:
        return
    assert k_buffer[0].is_contiguous() and v_buffer[0].is_contiguous()
    S, Hkv, D = k_buffer.shape
    kb, vb = k_buffer.view(S, -1), v_buffer.view(S, -1)
    k2, v2 = _rows(k), _rows(v)
    block_d = next_pow2(D)
    block_h = max(1, min(next_pow2(Hkv), 1024 // block_d))
    _store_kv_kernel[(n, triton.cdiv(Hkv, block_h))](
        kb, vb, k_scale_arg, v_scale_arg, loc.contiguous(), k2, v2, Hkv,
        kb.stride(0), vb.stride(0), k2.stride(0), v2.stride(0),
        D=D, BLOCK_H=block_h, BLOCK_D=block_d, QUANT=quantized,
        QMAX=qmax(k_buffer.dtype) if quantized else 0.0,
        ROUND=quantized and not k_buffer.dtype.is_floating_point,
    )


def store_kv_ref(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
    *,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: given exactly for a quantized pool
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
) -> None:
    """Torch reference, in place. Slots in `loc` are distinct (duplicates: last write unspecified)."""
    if not kernel_scales(k_buffer, v_buffer, k_scale, v_scale)[2]:
        k_buffer[loc] = k.to(k_buffer.dtype)
        v_buffer[loc] = v.to(v_buffer.dtype)
        return
    k_buffer[loc], k_scale[loc] = quantize_kv_ref(k, k_buffer.dtype)
    v_buffer[loc], v_scale[loc] = quantize_kv_ref(v, v_buffer.dtype)


def store_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
    *,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: given exactly for a quantized pool
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
) -> None:
    """Write k[i], v[i] into slot loc[i] of the pool buffers, in place (quantized, with
    their scales, into a quantized pool)."""
    if use_triton(k_buffer, v_buffer, loc, k, v):
        store_kv_triton(k_buffer, v_buffer, loc, k, v, k_scale=k_scale, v_scale=v_scale)
    else:
        store_kv_ref(k_buffer, v_buffer, loc, k, v, k_scale=k_scale, v_scale=v_scale)
