"""Decode attention over a paged KV pool: one new query token per request.

Request b attends, without a mask, over the slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
of k_buffer / v_buffer, or with a sliding `window` W over the last min(len, W) of them
(the new token at position len - 1 sees positions len - W ..= len - 1); with a
`softcap` the scaled scores are capped before the softmax (`softcap.py`); with `sinks`
([Hq] float32, gpt-oss) query head h's softmax denominator gains exp(sinks[h]), a logit
neither scaled nor capped that weighs no value. A quantized pool's K/V are dequantized on
load by `k_scale` / `v_scale` (`kv_quant`'s rule). GQA: query head h reads kv head
h // (Hq // Hkv). Softmax is computed in float32; the output has q's dtype. A request
with no context gets zeros.
"""

from __future__ import annotations

import torch

from ._dispatch import dot_in_f32, next_pow2, use_triton
from ._triton import tl, triton
from .kv_quant import dequantize_tile, kernel_scales
from .paged import check_sinks, check_window, request_attention_ref
from .softcap import check_softcap, tanh_tile


@triton.jit
def _decode_stage1_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    kv_indptr_ptr,  # [B+1]
    kv_indices_ptr,  # [N]
    k_scale_ptr,  # [S, Hkv] float16 (read when KV_QUANT)
    v_scale_ptr,  # [S, Hkv] float16
    part_o_ptr,  # [B, Hq, NUM_SPLITS, BLOCK_D] float32: split-normalised partial output
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32: log-sum-exp of the split (-inf if empty)
    sm_scale,  # divided by the cap when SOFTCAP
    window,  # positions a token sees, its own included (read when WINDOWED)
    softcap,  # the cap on the scores (read when SOFTCAP)
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_scale,  # slot stride of the scales (their head stride is 1)
    num_splits,
    GROUP: tl.constexpr,  # Hq // Hkv
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= max(16, GROUP): rows of the tl.dot
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast tl.dot operands (the interpreter mis-multiplies bf16)
    KV_QUANT: tl.constexpr,  # the pool is quantized: dequantize K and V to q's dtype on load
    WINDOWED: tl.constexpr,  # only the last `window` positions are visible
    SOFTCAP: tl.constexpr,  # a score s becomes softcap * tanh(s / softcap) before the mask
):
    """One program: request b, one KV head with all its query heads, one split of the
    visible context [first, ctx_len). A split past the visible positions (more splits
    than positions) writes log-sum-exp -inf, which stage 2 gives weight 0."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    ctx_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - ctx_start
    if WINDOWED:
        first = tl.maximum(ctx_len - window, 0)
        split_len = tl.cdiv(ctx_len - first, num_splits)
        lo = first + split * split_len
    else:
        split_len = tl.cdiv(ctx_len, num_splits)
        lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)

    g = tl.arange(0, BLOCK_H)  # [BH]
    heads = kvh * GROUP + g  # [BH]
    hmask = g < GROUP
    d = tl.arange(0, BLOCK_D)  # [BD]
    dmask = d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :], other=0.0,
    )  # [BH, BD]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BN]
        nmask = n < hi
        slot = tl.load(kv_indices_ptr + ctx_start + n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BN, BD]
        if KV_QUANT:
            k_scale = tl.load(k_scale_ptr + slot * stride_scale + kvh, mask=nmask, other=0.0)  # [BN]
            k = dequantize_tile(k, k_scale, q_ptr.dtype.element_ty)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [BH, BN]
        if SOFTCAP:  # sm_scale came divided by the cap
            qk = softcap * tanh_tile(qk)
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BN, BD]
        if KV_QUANT:
            v_scale = tl.load(v_scale_ptr + slot * stride_scale + kvh, mask=nmask, other=0.0)  # [BN]
            v = dequantize_tile(v, v_scale, q_ptr.dtype.element_ty)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BH]
    if hi > lo:
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], acc / l_i[:, None],
                 mask=hmask[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log(l_i), mask=hmask)
    else:
        tl.store(part_lse_ptr + row, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hmask)


@triton.jit
def _decode_stage2_kernel(
    part_o_ptr,  # [B, Hq, NUM_SPLITS, BLOCK_D] float32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32
    sinks_ptr,  # [Hq] float32: each query head's sink logit (read when SINKS)
    o_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SINKS: tl.constexpr,  # the head's sink logit joins the softmax denominator
):
    """One program per (request, query head): merge the splits by log-sum-exp. The sink
    joins here, once per head whatever the splits: the merged denominator gains
    exp(sink) (a request with no context still gets zeros)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)  # [BS]
    d = tl.arange(0, BLOCK_D)  # [BD]
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s < num_splits,
                  other=float("-inf"))  # [BS]
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(valid, tl.exp(lse - m), 0.0)  # [BS]
    po = tl.load(part_o_ptr + (row * num_splits + s[:, None]) * BLOCK_D + d[None, :],
                 mask=valid[:, None], other=0.0)  # [BS, BD]
    denom = tl.sum(w, 0)
    if SINKS:
        denom = denom + tl.exp(tl.load(sinks_ptr + h) - m)
    o = tl.sum(po * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BD]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty),
             mask=d < D)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU interpreter, which runs
    programs one after another: a context is then split only where requests and KV heads
    make fewer than two programs (an interpreted program costs the same on a short split
    as on a whole short context). Several splits are checked at the kernel
    (`num_kv_splits`) and at the attention backend (`num_sms` raised) against the torch
    reference."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_kv_splits(batch: int, num_kv_heads: int, sms: int) -> int:
    """Splits so that stage 1 has about two programs per SM (1..32); depends only on shapes."""
    programs = max(1, batch * num_kv_heads)
    return max(1, min(32, -(-2 * sms // programs)))


def decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16, contiguous: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16, contiguous
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [B, Hq, D]
    """Split-KV flash decoding: stage 1 per (request, KV head, split), stage 2 merges.

    `num_kv_splits` None picks `default_num_kv_splits` (a function of B and Hkv only, so a
    captured CUDA graph stays valid). With a sliding `window` the splits share each
    request's visible positions, found on the device (the window is a kernel argument:
    a captured graph stays valid for any context lengths). A `softcap` is a kernel
    argument too (the `SOFTCAP` variant), and so are `sinks` (stage 2's `SINKS` variant,
    read on the device). Requires the last dim of q, k_buffer, v_buffer (and out) to be
    contiguous.
    """
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, q)
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    if B == 0:
        return out
    group = Hq // Hkv
    block_d = max(16, next_pow2(D))
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(B, Hkv, num_sms(q.device))
    splits = max(1, num_kv_splits)
    part_o = torch.empty((B, Hq, splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    k_scale_arg, v_scale_arg, quantized = kernel_scales(k_buffer, v_buffer, k_scale, v_scale)
    _decode_stage1_kernel[(B, Hkv, splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices,
        k_scale_arg, v_scale_arg, part_o, part_lse, sm_scale if softcap is None else sm_scale / softcap,
        0 if window is None else window, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), Hkv, splits,
        GROUP=group, D=D, BLOCK_H=max(16, next_pow2(group)), BLOCK_D=block_d,
        BLOCK_N=32 if block_d > 128 else 64,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=dot_in_f32(q.dtype), KV_QUANT=quantized, WINDOWED=window is not None,
        SOFTCAP=softcap is not None, num_warps=4, num_stages=2,
    )
    _decode_stage2_kernel[(B, Hq)](
        part_o, part_lse, part_lse if sinks is None else sinks,  # any pointer when there are none
        out, out.stride(0), out.stride(1), splits,
        D=D, BLOCK_D=block_d, BLOCK_S=next_pow2(splits), SINKS=sinks is not None, num_warps=4,
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1] int
    kv_indices: torch.Tensor,  # [N] int
    *,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [B, Hq, D]
    """Torch reference: request by request, its one query token attends to its whole
    context, or to its last `window` slots, its scores capped by a `softcap`, its heads'
    softmax denominators gaining exp(`sinks`) (`request_attention_ref`), in float32. A
    request with no context gets zeros."""
    check_sinks(sinks, q)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    bounds = kv_indptr.tolist()
    for b in range(q.shape[0]):
        start, end = bounds[b], bounds[b + 1]
        if end > start:
            slots = kv_indices[start:end].to(torch.int64)
            out[b] = request_attention_ref(
                q[b : b + 1], k_buffer, v_buffer, slots,
                sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks,
            )[0]
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention (over the last `window` slots of each context with a sliding
    window; scores capped by a `softcap`; each head's softmax denominator gaining exp of its
    entry of `sinks`); Triton split-KV flash-decoding on CUDA, the reference otherwise."""
    if use_triton(q, k_buffer, v_buffer, kv_indptr, kv_indices, sinks):
        return decode_attention_triton(
            q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale=sm_scale, num_kv_splits=num_kv_splits,
            out=out, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks,
        )
    o = decode_attention_ref(
        q, k_buffer, v_buffer, kv_indptr, kv_indices,
        sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks,
    )
    if out is None:
        return o
    out.copy_(o)
    return out
