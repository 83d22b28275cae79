"""Scatter new tokens' K/V into the paged KV pool: buffer[loc[i]] = new[i]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import use_triton


@triton.jit
def _store_kv_kernel(
    k_buf_ptr,  # [S, Hkv*D] rows contiguous
    v_buf_ptr,  # [S, Hkv*D]
    loc_ptr,  # [n]
    k_ptr,  # [n, Hkv*D]
    v_ptr,  # [n, Hkv*D]
    row,  # Hkv * D
    stride_kb,
    stride_vb,
    stride_k,
    stride_v,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row
    slot = tl.load(loc_ptr + i).to(tl.int64)
    k = tl.load(k_ptr + i * stride_k + cols, mask=mask)
    v = tl.load(v_ptr + i * stride_v + cols, mask=mask)
    tl.store(k_buf_ptr + slot * stride_kb + cols, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * stride_vb + cols, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:  # [m, H, D] -> [m, H*D] with unit inner stride
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv_triton(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
) -> None:
    """Triton launcher: grid (tokens, blocks of Hkv*D). Buffers must have contiguous rows."""
    n = loc.shape[0]
    if n == 0:
        return
    assert k_buffer[0].is_contiguous() and v_buffer[0].is_contiguous()
    kb, vb = k_buffer.view(k_buffer.shape[0], -1), v_buffer.view(v_buffer.shape[0], -1)
    k2, v2 = _rows(k), _rows(v)
    row = kb.shape[1]
    block = min(1024, 1 << max(0, (row - 1).bit_length()))
    _store_kv_kernel[(n, triton.cdiv(row, block))](
        kb, vb, loc.contiguous(), k2, v2, row,
        kb.stride(0), vb.stride(0), k2.stride(0), v2.stride(0), BLOCK=block,
    )


def store_kv_ref(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
) -> None:
    """Torch reference, in place. Slots in `loc` are distinct (duplicates: last write unspecified)."""
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)


def store_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [n] int
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,  # [n, Hkv, D]
) -> None:
    """Write k[i], v[i] into slot loc[i] of the pool buffers, in place."""
    if use_triton(k_buffer, v_buffer, loc, k, v):
        store_kv_triton(k_buffer, v_buffer, loc, k, v)
    else:
        store_kv_ref(k_buffer, v_buffer, loc, k, v)
