"""Mixture-of-experts feed-forward: top-k routing and the experts' SwiGLU blocks.

Weights of E experts are stacked: `w13 [E, 2I, H]` holds each expert's gate rows, then its
up rows; `w2 [E, H, I]` its down projection. Token t's output is

    sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t, k]

summed over k = 0 .. K-1 in that order, in float32, then rounded to x's dtype; so a token's
output depends only on its own row (never on which other tokens share its experts), on
both paths.

The torch reference groups the token-expert pairs by expert and runs one matmul per expert
that has any (it reads the group sizes on the host). The Triton path never does: it sorts
the pairs by expert into blocks of `BLOCK_M` rows padded per expert (a fixed-size layout
for a given token count, built with device ops only), and each program multiplies one
block by one tile of its expert's weights; blocks past the last expert's return at once.
Nothing in it synchronises with the host, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import dot_in_f32, use_triton
from ._triton import tl, triton

BLOCK_M = 16  # token-expert pairs per program
BLOCK_N = 64
BLOCK_K = 64


def route_topk(
    logits: torch.Tensor,  # [T, E] router logits
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] float32, ids [T, K] int64
    """Each token's `top_k` experts by softmax probability (in float32), highest first,
    and their probabilities, renormalized to sum to 1 when `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _combine(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T * K, H] per-pair outputs -> [T, H]: weighted, summed over k in order, in float32."""
    T, K = weights.shape
    return (out.view(T, K, -1).float() * weights[..., None]).sum(dim=1).to(dtype)


def fused_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, H], x's dtype
    """Torch reference: one matmul pair per expert over the rows routed to it."""
    K = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[order // K]  # [T * K, H]
    out = torch.empty_like(rows)
    inter = w13.shape[1] // 2
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = slice(start, start + n)
            gate_up = F.linear(rows[seg], w13[e])  # [n, 2I]
            out[seg] = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
            start += n
    per_pair = torch.empty_like(out)
    per_pair[order] = out
    return _combine(per_pair, weights, x.dtype)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout of the Triton path, from device ops only (no host sync).

    Returns `pairs [P]`: at each row, the index t * K + k of the pair it holds, or T * K for
    a padding row; each expert's pairs fill whole blocks of `block_m` rows, in expert order,
    pairs of one expert in token order. And `block_expert [P / block_m]`: each block's
    expert, or -1 for the blocks past the last one used. P = T * K + E * (block_m - 1),
    rounded up to a multiple of block_m: enough for any routing."""
    flat = ids.reshape(-1)
    n = flat.numel()
    capacity = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)  # [E]
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    first = torch.cumsum(counts, 0) - counts  # [E]: each expert's first sorted position
    order = torch.argsort(flat, stable=True)  # [n]
    expert = flat[order]
    dest = padded_start[expert] + torch.arange(n, device=ids.device) - first[expert]
    pairs = torch.full((capacity,), n, dtype=torch.int64, device=ids.device)
    pairs.scatter_(0, dest, order)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs, block_expert


@triton.jit
def _expert_matmul_kernel(
    a_ptr,  # [rows, KDIM]: x (GATE_UP: row = pair // TOP_K) or the activations (row = pair)
    w_ptr,  # [E, N_ROWS, KDIM]
    out_ptr,  # [n_pairs, N]
    pairs_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    n_pairs,
    N,  # output columns (I when GATE_UP: the up rows follow at offset N)
    KDIM,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pair < n_pairs
    row = pair // TOP_K if GATE_UP else pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < KDIM
        a = tl.load(a_ptr + row[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w)
        if GATE_UP:
            u = tl.load(w_base + (cols[None, :] + N) * stride_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up += tl.dot(a, u)
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:  # round each projection to the activations' dtype first, as torch does
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up
    tl.store(out_ptr + pair[:, None] * stride_out + cols[None, :], acc.to(dtype),
             mask=valid[:, None] & col_ok[None, :])


def fused_experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, H], x's dtype
    """Triton launcher: the gate/up kernel (SwiGLU fused) into per-pair activations, the
    down kernel into per-pair outputs, then the weighted sum over k."""
    T, K = ids.shape
    E, two_inter, H = w13.shape
    inter = two_inter // 2
    n = T * K
    if n == 0:
        return x.new_empty((0, H))
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, block_expert = align_by_expert(ids, E, BLOCK_M)
    upcast = dot_in_f32(x.dtype)
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, H), dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    _expert_matmul_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, act, pairs, block_expert, n, inter, H, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=K, GATE_UP=True, UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    _expert_matmul_kernel[(blocks, triton.cdiv(H, BLOCK_N))](
        act, w2, out, pairs, block_expert, n, H, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=K, GATE_UP=False, UPCAST=upcast, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return _combine(out, weights, x.dtype)


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, H], x's dtype
    """The experts' weighted SwiGLU outputs (see the module docstring)."""
    if use_triton(x, w13, w2):
        return fused_experts_triton(x, w13, w2, weights, ids)
    return fused_experts_ref(x, w13, w2, weights, ids)
