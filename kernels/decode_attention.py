"""Decode attention over a paged KV pool: one new query token per request.

Request b attends, without a mask, over the slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]
of k_buffer / v_buffer. GQA: query head h reads kv head h // (Hq // Hkv). Softmax is
computed in float32; the output has q's dtype. A request with no context gets zeros.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import dot_in_f32, next_pow2, use_triton
from .attention_lse import attention_lse


@triton.jit
def _decode_stage1_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    kv_indptr_ptr,  # [B+1]
    kv_indices_ptr,  # [N]
    part_o_ptr,  # [B, Hq, NUM_SPLITS, BLOCK_D] float32: split-normalised partial output
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32: log-sum-exp of the split (-inf if empty)
    sm_scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    num_splits,
    GROUP: tl.constexpr,  # Hq // Hkv
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= max(16, GROUP): rows of the tl.dot
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast tl.dot operands (the interpreter mis-multiplies bf16)
):
    """One program: request b, one KV head with all its query heads, one split of the context."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    ctx_len = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - ctx_start
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
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # [BH, BN]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BN, BD]
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
    o_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per (request, query head): merge the splits by log-sum-exp."""
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
    o = tl.sum(po * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BD]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty),
             mask=d < D)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: keep the grid small
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits so that stage 1 has about two programs per SM (1..32); depends only on shapes."""
    programs = max(1, batch * num_kv_heads)
    return max(1, min(32, -(-2 * _num_sms(device) // programs)))


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
) -> torch.Tensor:  # [B, Hq, D]
    """Split-KV flash decoding: stage 1 per (request, KV head, split), stage 2 merges.

    `num_kv_splits` None picks `default_num_kv_splits` (a function of B and Hkv only, so a
    captured CUDA graph stays valid). Requires the last dim of q, k_buffer, v_buffer (and out) to be contiguous.
    """
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
        num_kv_splits = default_num_kv_splits(B, Hkv, q.device)
    splits = max(1, num_kv_splits)
    part_o = torch.empty((B, Hq, splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    _decode_stage1_kernel[(B, Hkv, splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, part_o, part_lse, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), splits,
        GROUP=group, D=D, BLOCK_H=max(16, next_pow2(group)), BLOCK_D=block_d,
        BLOCK_N=32 if block_d > 128 else 64,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=dot_in_f32(q.dtype),
        num_warps=4, num_stages=2,
    )
    _decode_stage2_kernel[(B, Hq)](
        part_o, part_lse, out, out.stride(0), out.stride(1), splits,
        D=D, BLOCK_D=block_d, BLOCK_S=next_pow2(splits), num_warps=4,
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1] int32
    kv_indices: torch.Tensor,  # [N] int32
    *,
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Torch reference (the CPU path), float32 math; see `decode_attention_lse_ref`."""
    o, _ = decode_attention_lse_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale=sm_scale)
    return o.to(q.dtype)


def decode_attention_lse_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1] int
    kv_indices: torch.Tensor,  # [N] int
    *,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] float32, [B, Hq] float32
    """Decode attention and the log-sum-exp of each row's scaled scores, in float32 (so
    that partial results over disjoint parts of a context can be merged exactly).
    A request with no context gets zeros and -inf."""
    buckets = pad_by_length(kv_indptr, kv_indices)
    return attend_padded(
        q, buckets, lambda _, bucket: gather_bucket_kv(k_buffer, v_buffer, bucket), sm_scale=sm_scale
    )


@dataclass(frozen=True)
class PaddedRows:
    """Requests of similar context length, their slots padded to the longest."""

    rows: torch.Tensor  # [b] int64: batch rows
    slots: torch.Tensor  # [b, L] int64 (padding repeats a slot of the batch)
    valid: torch.Tensor | None  # [b, L] bool; None when nothing is padding
    lens: torch.Tensor  # [b] int64: each row's context length (its valid slots)
    # (the bucket a decode step earlier, the positions of its rows this one keeps) when
    # requests left between the steps; weak, so that a run of such steps is no chain
    kept_from: tuple[weakref.ref[PaddedRows], torch.Tensor] | None = None

    def grown(self, new_slots: torch.Tensor, moved: torch.Tensor | None = None) -> PaddedRows | None:
        """The bucket one decode step later: each row's context gains the slot
        `new_slots[row]` (rows of the new batch; the padding still at most doubles a row's
        work). With `moved` (old batch row -> new row, -1 for a request that left) the
        rows that left are dropped; None if none is left."""
        if moved is None:
            kept, keep = self, None
        else:
            rows = moved[self.rows]
            keep = torch.nonzero(rows >= 0).flatten()  # [b'] positions kept
            if keep.numel() == 0:
                return None
            valid = None if self.valid is None else self.valid[keep]
            kept = PaddedRows(rows[keep], self.slots[keep], valid, self.lens[keep])
        b = kept.slots.shape[0]
        at = torch.arange(b, device=kept.slots.device)
        slots = torch.cat([kept.slots, kept.slots[:, :1]], dim=1)  # [b, L+1]
        slots[at, kept.lens] = new_slots[kept.rows]
        valid = None
        if kept.valid is not None:
            valid = torch.cat([kept.valid, kept.valid[:, :1].logical_not()], dim=1)  # [b, L+1]
            valid[at, kept.lens] = True
        return PaddedRows(kept.rows, slots, valid, kept.lens + 1, None if keep is None else (weakref.ref(self), keep))


def pad_by_length(kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> list[PaddedRows]:
    """Requests with context, bucketed by length so that padding at most doubles a
    bucket's work (longest first; a bucket's shortest is over half its longest). A lone
    bucket keeps the batch's row order. Depends only on the batch's metadata: a step
    computes it once for all layers."""
    indptr = kv_indptr.to(torch.int64)
    indices = kv_indices.to(device=indptr.device, dtype=torch.int64)
    lens = indptr[1:] - indptr[:-1]  # [B]
    n = lens.tolist()
    order = sorted((i for i, length in enumerate(n) if length > 0), key=lambda i: -n[i])
    runs: list[list[int]] = []
    for i in order:
        if runs and 2 * n[i] > n[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) == 1:
        runs[0].sort()
    buckets = []
    for run in runs:
        longest, shortest = max(n[i] for i in run), min(n[i] for i in run)
        rows = torch.tensor(run, device=indptr.device)  # [b]
        offs = torch.arange(longest, device=indptr.device)  # [L]
        valid = offs[None, :] < lens[rows, None]  # [b, L]
        slots = indices[torch.where(valid, indptr[rows, None] + offs[None, :], 0)]  # [b, L]
        buckets.append(PaddedRows(rows, slots, None if shortest == longest else valid, lens[rows]))
    return buckets


BucketKV = Callable[[int, PaddedRows], tuple[torch.Tensor, torch.Tensor]]
"""(bucket index, bucket) -> its K and V, [b, Hkv, L, D] each, any strides and dtype."""


def attend_padded(
    q: torch.Tensor,  # [B, Hq, D]
    buckets: list[PaddedRows],
    bucket_kv: BucketKV,
    *,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] float32, [B, Hq] float32
    """Each bucket in one `attention_lse` call, a KV head's query heads as its query rows
    (the K/V are read once for all of them); rows in no bucket get zeros and -inf."""
    B, Hq, D = q.shape

    def attend(i: int, bucket: PaddedRows, rows_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = bucket_kv(i, bucket)
        b, Hkv = k.shape[:2]
        valid = None if bucket.valid is None else bucket.valid[:, None, None, :]
        o, s = attention_lse(rows_q.view(b, Hkv, Hq // Hkv, D), k, v, scale=sm_scale, valid=valid)
        return o.reshape(b, Hq, D), s.reshape(b, Hq)

    if len(buckets) == 1 and buckets[0].rows.numel() == B:  # every row, in batch order
        return attend(0, buckets[0], q)
    every_row = sum(bucket.rows.numel() for bucket in buckets) == B
    out = (torch.empty if every_row else torch.zeros)((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i, bucket in enumerate(buckets):
        o, s = attend(i, bucket, q[bucket.rows])
        out.index_copy_(0, bucket.rows, o)
        lse.index_copy_(0, bucket.rows, s)
    return out, lse


def gather_bucket_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    bucket: PaddedRows,
) -> tuple[torch.Tensor, torch.Tensor]:  # [b, Hkv, L, D] x2, views of fresh copies
    """The bucket's K and V, gathered from the pool (the `BucketKV` of the reference)."""
    b, L = bucket.slots.shape
    Hkv, D = k_buffer.shape[1:]
    flat = bucket.slots.reshape(-1)
    k = gather_rows(k_buffer, flat).view(b, L, Hkv, D).transpose(1, 2)
    v = gather_rows(v_buffer, flat).view(b, L, Hkv, D).transpose(1, 2)
    return k, v


def gather_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [n, *buffer.shape[1:]]
    """`buffer[slots]` for a pool buffer [S, ...] and int64 slots [n]: one row copy per
    slot (indexing the 2-D view copies whole rows, about twice as fast on the CPU)."""
    return buffer.view(buffer.shape[0], -1).index_select(0, slots).view(-1, *buffer.shape[1:])


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
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention; Triton split-KV flash-decoding on CUDA, the reference otherwise."""
    if use_triton(q, k_buffer, v_buffer, kv_indptr, kv_indices):
        return decode_attention_triton(
            q, k_buffer, v_buffer, kv_indptr, kv_indices,
            sm_scale=sm_scale, num_kv_splits=num_kv_splits, out=out,
        )
    o = decode_attention_ref(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale=sm_scale)
    if out is None:
        return o
    out.copy_(o)
    return out
