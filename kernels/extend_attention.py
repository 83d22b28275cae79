"""Extend (prefill) attention over a paged KV pool; the new tokens' K/V are already stored.

Request b has q_len = qo_indptr[b+1]-qo_indptr[b] new tokens and kv_len =
kv_indptr[b+1]-kv_indptr[b] context slots (prefix then new tokens, in position order;
kv_len >= q_len). New token i sits at position p = kv_len - q_len + i and attends to
context positions 0 ..= p, or with `attend_until` (one int64 per new token, p + 1 <=
attend_until[i] <= kv_len: an image block's tokens see the whole block) to those below
attend_until[i]; with a sliding `window` W only to those from max(0, p - W + 1) on.
With a `softcap` the scaled scores are capped before the mask (`softcap.py`). With
`sinks` ([Hq] float32, gpt-oss) query head h's softmax denominator gains exp(sinks[h]), a
logit neither scaled nor capped that weighs no value. GQA: query head h reads kv head
h // (Hq // Hkv). Softmax in float32; output in q's dtype. A quantized pool's K/V are
dequantized on load by `k_scale` / `v_scale` (`kv_quant`'s rule).
"""

from __future__ import annotations

import torch

from ._dispatch import dot_in_f32, next_pow2, use_triton
from ._triton import tl, triton
from .kv_quant import dequantize_tile, kernel_scales
from .paged import (
    banded_attention_ref,
    check_attend_until,
    check_sinks,
    check_window,
    request_attention_ref,
)
from .softcap import check_softcap, tanh_tile

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)  # the same, as a kernel may read a global


@triton.jit
def _attend_range(
    acc, l_i, m_i,  # running output [BM, BD], sum [BM], max [BM] (float32)
    q,  # [BM, BD]
    k_ptr, v_ptr, kv_indices_ptr, ctx_start, kvh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    k_scale_ptr, v_scale_ptr, stride_scale,  # a quantized pool's scales [S, Hkv] (KV_QUANT)
    lo, hi,  # context positions [lo, hi) to visit
    row_pos,  # [BM] position of each query row (used when WINDOWED)
    row_end,  # [BM] the first position each query row no longer sees (used when CAUSAL)
    window,  # positions a row sees, its own included (used when WINDOWED)
    qk_scale,  # sm_scale * log2(e): scores in base 2, so the softmax uses exp2 (SOFTCAP: sm_scale / cap)
    softcap,  # cap * log2(e) (used when SOFTCAP)
    CAUSAL: tl.constexpr,  # a row sees no position at or past its row_end
    WINDOWED: tl.constexpr,  # a row sees no position `window` or more before its own
    SOFTCAP: tl.constexpr,  # a score s becomes cap * tanh(s / cap) before the mask
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_DTYPE: tl.constexpr,  # what quantized K/V dequantize to: q's dtype
):
    """Online-softmax accumulation over one range of context positions; m_i is the running
    max of the base-2 scores (-inf while a row has seen nothing, which only a WINDOWED
    range can leave it at)."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BN]
        nmask = n < hi
        slot = tl.load(kv_indices_ptr + ctx_start + n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BN, BD]
        if KV_QUANT:
            k_scale = tl.load(k_scale_ptr + slot * stride_scale + kvh, mask=nmask, other=0.0)  # [BN]
            k = dequantize_tile(k, k_scale, KV_DTYPE)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BM, BN]
        if SOFTCAP:  # s / cap, capped, times cap * log2(e): the capped score in base 2
            qk = tanh_tile(qk) * softcap
        keep = nmask[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] < row_end[:, None])
        if WINDOWED:
            keep = keep & (n[None, :] > row_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if WINDOWED:  # a row that has seen nothing yet: exp2(-inf - 0) = 0, not NaN
            m_exp = tl.where(m_new > float("-inf"), m_new, 0.0)
        else:
            m_exp = m_new
        alpha = tl.exp2(m_i - m_exp)
        p = tl.exp2(qk - m_exp[:, None])
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BN, BD]
        if KV_QUANT:
            v_scale = tl.load(v_scale_ptr + slot * stride_scale + kvh, mask=nmask, other=0.0)  # [BN]
            v = dequantize_tile(v, v_scale, KV_DTYPE)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    o_ptr,  # [T, Hq, D]
    qo_indptr_ptr,  # [B+1]
    kv_indptr_ptr,  # [B+1]
    kv_indices_ptr,  # [N]
    until_ptr,  # [T] int64: each new token's attend_until (read when ATTEND_UNTIL)
    sinks_ptr,  # [Hq] float32: each query head's sink logit (read when SINKS)
    k_scale_ptr,  # [S, Hkv] float16 (read when KV_QUANT)
    v_scale_ptr,  # [S, Hkv] float16
    qk_scale,  # sm_scale * log2(e); sm_scale / cap when SOFTCAP
    window,  # positions a token sees, its own included (read when WINDOWED)
    softcap,  # cap * log2(e) (read when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_scale,  # slot stride of the scales (their head stride is 1)
    GROUP: tl.constexpr,  # Hq // Hkv
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the pool is quantized: dequantize K and V to q's dtype on load
    WINDOWED: tl.constexpr,  # a row sees only the `window` positions ending at its own
    SOFTCAP: tl.constexpr,  # scores are capped before the mask
    ATTEND_UNTIL: tl.constexpr,  # a row sees the positions below its attend_until, not just to its own
    SINKS: tl.constexpr,  # the head's sink logit joins the softmax denominator
):
    """One program: request b, query head h, BLOCK_M consecutive new tokens. The block's
    rows see positions below the diagonal block without a causal mask; with a window, the
    positions some row of the block no longer sees are skipped whole and those only its
    later rows no longer see are masked. With ATTEND_UNTIL the block visits positions up
    to the largest attend_until of its rows; those from the diagonal that every row sees
    (in whole key blocks) go without the per-row mask. With SINKS the finished online
    softmax's denominator gains exp(sink) (in the running max's base-2 frame)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b).to(tl.int64)
    q_len = tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - q_start
    m_start = mb * BLOCK_M
    if m_start < q_len:
        ctx_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
        kv_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - ctx_start
        prefix = kv_len - q_len
        kvh = h // GROUP
        m = m_start + tl.arange(0, BLOCK_M)  # [BM]
        mmask = m < q_len
        d = tl.arange(0, BLOCK_D)  # [BD]
        dmask = d < D
        q = tl.load(q_ptr + (q_start + m[:, None]) * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BM, BD]
        if DOT_F32:
            q = q.to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_pos = prefix + m  # [BM]
        diag = prefix + m_start  # the block's first row's position
        if ATTEND_UNTIL:  # a padding row sees what the farthest-seeing real row sees
            row_end = tl.load(until_ptr + q_start + m, mask=mmask, other=0)  # [BM]
            hi = tl.max(row_end)
            row_end = tl.where(mmask, row_end, hi)
            all_see_to = diag + (tl.min(row_end) - diag) // BLOCK_N * BLOCK_N
        else:
            row_end = row_pos + 1
            hi = tl.minimum(diag + BLOCK_M, kv_len)
            all_see_to = diag
        if WINDOWED:
            # a row sees from its position - window + 1 on: the first row from `lo`, the
            # last real one from `seen_by_all`; [lo, full) is masked, in whole blocks
            # from lo, so that the unmasked range adds no partial block
            lo = tl.maximum(diag - window + 1, 0)
            last = prefix + tl.minimum(m_start + BLOCK_M, q_len) - 1
            seen_by_all = tl.maximum(last - window + 1, lo)
            full = tl.minimum(lo + tl.cdiv(seen_by_all - lo, BLOCK_N) * BLOCK_N, diag)
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, k_ptr, v_ptr, kv_indices_ptr, ctx_start, kvh,
                stride_ks, stride_kh, stride_vs, stride_vh, k_scale_ptr, v_scale_ptr, stride_scale,
                lo, full, row_pos, row_end, window, qk_scale, softcap,
                CAUSAL=False, WINDOWED=True, SOFTCAP=SOFTCAP, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                PRECISION=PRECISION, DOT_F32=DOT_F32, KV_QUANT=KV_QUANT, KV_DTYPE=q_ptr.dtype.element_ty,
            )
        else:
            full = 0
        # every row of this block sees all of [full, diag): no mask there
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, k_ptr, v_ptr, kv_indices_ptr, ctx_start, kvh,
            stride_ks, stride_kh, stride_vs, stride_vh, k_scale_ptr, v_scale_ptr, stride_scale,
            full, diag, row_pos, row_end, window, qk_scale, softcap,
            CAUSAL=False, WINDOWED=False, SOFTCAP=SOFTCAP, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
            PRECISION=PRECISION, DOT_F32=DOT_F32, KV_QUANT=KV_QUANT, KV_DTYPE=q_ptr.dtype.element_ty,
        )
        if ATTEND_UNTIL:  # every row sees all of [diag, all_see_to), but a window may cut it
            acc, l_i, m_i = _attend_range(
                acc, l_i, m_i, q, k_ptr, v_ptr, kv_indices_ptr, ctx_start, kvh,
                stride_ks, stride_kh, stride_vs, stride_vh, k_scale_ptr, v_scale_ptr, stride_scale,
                diag, all_see_to, row_pos, row_end, window, qk_scale, softcap,
                CAUSAL=False, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                PRECISION=PRECISION, DOT_F32=DOT_F32, KV_QUANT=KV_QUANT, KV_DTYPE=q_ptr.dtype.element_ty,
            )
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, k_ptr, v_ptr, kv_indices_ptr, ctx_start, kvh,
            stride_ks, stride_kh, stride_vs, stride_vh, k_scale_ptr, v_scale_ptr, stride_scale,
            all_see_to, hi, row_pos, row_end, window, qk_scale, softcap,
            CAUSAL=True, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
            PRECISION=PRECISION, DOT_F32=DOT_F32, KV_QUANT=KV_QUANT, KV_DTYPE=q_ptr.dtype.element_ty,
        )
        if SINKS:  # m_i is finite for every real row: it sees at least its own position
            l_i = l_i + tl.exp2(tl.load(sinks_ptr + h) * LOG2E_IN_KERNEL - m_i)
        if WINDOWED:  # a padding row past the last real one may have seen nothing
            l_i = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_i[:, None]
        tl.store(o_ptr + (q_start + m[:, None]) * stride_ot + h * stride_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def extend_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1] int32
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16, contiguous: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16, contiguous
    window: int | None = None,
    softcap: float | None = None,
    attend_until: torch.Tensor | None = None,  # [T] int64
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [T, Hq, D]
    """Flash-attention launcher: grid (requests, query heads, blocks of max_q_len).

    `max_q_len` must be >= every request's q_len (rows past it are silently not computed).
    A sliding `window` is a kernel argument (the positions a block visits are found on
    the device), and so are a `softcap` (the `SOFTCAP` variant), `attend_until` (the
    `ATTEND_UNTIL` variant: read on the device, its values unchecked) and `sinks` (the
    `SINKS` variant, read on the device). Requires the last dim of q, k_buffer, v_buffer
    (and out) to be contiguous.
    """
    check_window(window)
    check_softcap(softcap)
    check_attend_until(attend_until, q)
    check_sinks(sinks, q)
    T, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    B = qo_indptr.shape[0] - 1
    if T == 0 or B == 0 or max_q_len <= 0:
        return out
    block_d = max(16, next_pow2(D))
    block = 32 if block_d > 128 else 64
    # 3 stages measured fastest for D=128 bf16 on an H200 (benchmarks/RESULTS.md)
    stages = 3 if block_d <= 128 else 2
    k_scale_arg, v_scale_arg, quantized = kernel_scales(k_buffer, v_buffer, k_scale, v_scale)
    _extend_kernel[(B, Hq, triton.cdiv(max_q_len, block))](
        q, k_buffer, v_buffer, out, qo_indptr, kv_indptr, kv_indices,
        qo_indptr if attend_until is None else attend_until,  # any pointer when there is none
        qo_indptr if sinks is None else sinks,  # likewise
        k_scale_arg, v_scale_arg, sm_scale * LOG2E if softcap is None else sm_scale / softcap,
        0 if window is None else window, 1.0 if softcap is None else softcap * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1), Hkv,
        GROUP=Hq // Hkv, D=D, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=dot_in_f32(q.dtype), KV_QUANT=quantized, WINDOWED=window is not None,
        SOFTCAP=softcap is not None, ATTEND_UNTIL=attend_until is not None, SINKS=sinks is not None,
        num_warps=4, num_stages=stages,
    )
    return out


def extend_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1] int32
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
    window: int | None = None,
    softcap: float | None = None,
    attend_until: torch.Tensor | None = None,  # [T] int64
    sinks: torch.Tensor | None = None,  # [Hq] float32
    banded: bool = False,
) -> torch.Tensor:  # [T, Hq, D]
    """Torch reference (the CPU path): per request, gather the K/V its new tokens see and
    one masked SDPA, or written-out scores with a `softcap` or `sinks`
    (`request_attention_ref`, given the request's slice of `attend_until`). `banded`
    (the CPU backend's): a request whose context a `window` cuts, without `attend_until`,
    takes its queries in blocks, each over the slots its window reaches
    (`banded_attention_ref`); the reference backend takes one call."""
    check_attend_until(attend_until, q)
    check_sinks(sinks, q)
    out = torch.empty_like(q)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if q1 == q0:
            continue
        if k1 - k0 < q1 - q0:
            raise ValueError(f"request {b}: kv_len {k1 - k0} < q_len {q1 - q0}")
        slots = kv_indices[k0:k1].to(torch.int64)  # [L]
        options = {"sm_scale": sm_scale, "k_scale": k_scale, "v_scale": v_scale, "softcap": softcap, "sinks": sinks}
        if banded and window is not None and attend_until is None and k1 - k0 > window:
            out[q0:q1] = banded_attention_ref(q[q0:q1], k_buffer, v_buffer, slots, window=window, **options)
            continue
        out[q0:q1] = request_attention_ref(
            q[q0:q1], k_buffer, v_buffer, slots, window=window,
            attend_until=None if attend_until is None else attend_until[q0:q1], **options,
        )
    return out


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1] int32
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    k_scale: torch.Tensor | None = None,  # [S, Hkv] float16: a quantized pool's
    v_scale: torch.Tensor | None = None,  # [S, Hkv] float16
    window: int | None = None,
    softcap: float | None = None,
    attend_until: torch.Tensor | None = None,  # [T] int64
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [T, Hq, D]
    """Extend attention (within a sliding `window` when one is given, scores capped by a
    `softcap`, each new token seeing the positions below its `attend_until` when given,
    each head's softmax denominator gaining exp of its entry of `sinks` when given);
    Triton flash attention on CUDA, the reference otherwise."""
    if use_triton(q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, sinks):
        return extend_attention_triton(
            q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, sm_scale=sm_scale,
            max_q_len=max_q_len, out=out, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
            attend_until=attend_until, sinks=sinks,
        )
    o = extend_attention_ref(
        q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
        attend_until=attend_until, sinks=sinks,
    )
    if out is None:
        return o
    out.copy_(o)
    return out
