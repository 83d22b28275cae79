"""Mixture-of-experts feed-forward: top-k routing and the experts' gated blocks.

Weights of E experts are stacked: `w13 [E, 2I, H]` holds each expert's gate and up rows,
`w2 [E, H, I]` its down projection; either may be an `Mxfp4Weight` (gpt-oss's packed
codes, decoded exactly to x's dtype). Optional biases `b13 [E, 2I]` and `b2 [E, H]` are
rounded to x's dtype and added to the float32 accumulators before the projections are
rounded to x's dtype. Token t's output is

    sum_k weights[t, k] * (W2_e act(W13_e x_t + b13_e) + b2_e),  e = ids[t, k]

summed over k = 0 .. K-1 in that order, in float32, then rounded to x's dtype; so a token's
output depends only on its own row (never on which other tokens share its experts), on
both paths. `act` is SwiGLU on gate rows then up rows, silu(gate) * up in x's dtype (silu
rounded, then the product), or, with `activation=ClampedSwiGLU(...)`, gpt-oss's clamped
SwiGLU on interleaved rows, computed in float32 from the rounded projections and rounded
once.

The torch reference groups the token-expert pairs by expert and runs one matmul per expert
that has any (it reads the group sizes on the host, and dequantizes MXFP4 weights of those
experts only). The Triton path never does: it sorts the pairs by expert into blocks of
`BLOCK_M` rows padded per expert (a fixed-size layout for a given token count, built with
device ops only), and each program multiplies one block by one tile of its expert's
weights, decoding MXFP4 tiles in registers; blocks past the last expert's return at once.
Nothing in it synchronises with the host, so CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._dispatch import dot_in_f32, use_triton
from ._triton import tl, triton
from .mxfp4 import Mxfp4Weight, dequantize_mxfp4

BLOCK_M = 16  # token-expert pairs per program
BLOCK_N = 64
BLOCK_K = 64

ExpertWeight = torch.Tensor | Mxfp4Weight


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation. w13's rows are interleaved: row 2i is gate unit i, row
    2i+1 up unit i (not gate rows then up rows as in the plain SwiGLU layout). With
    g = min(gate, limit), u = clamp(up, -limit, limit): act_i = (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2I] -> [n, I]
        """In float32 (as (u + 1) * (g * sigmoid(g * alpha))), rounded to gate_up's dtype."""
        h = gate_up.float()
        g = h[:, 0::2].clamp(max=self.limit)
        u = h[:, 1::2].clamp(-self.limit, self.limit)
        return ((u + 1) * (g * torch.sigmoid(g * self.alpha))).to(gate_up.dtype)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2I] gate rows then up rows -> [n, I]
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _shape(w: ExpertWeight) -> tuple[int, int, int]:
    return w.shape if isinstance(w, Mxfp4Weight) else tuple(w.shape)


def _storage(w: ExpertWeight) -> torch.Tensor:
    return w.blocks if isinstance(w, Mxfp4Weight) else w


def _expert_weight(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [N, K] weight in dtype (MXFP4 dequantized exactly)."""
    return dequantize_mxfp4(w.blocks[e], w.scales[e], dtype) if isinstance(w, Mxfp4Weight) else w[e]


def _expert_bias(b: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor | None:
    return None if b is None else b[e].to(dtype)


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
    return (out.view(T, K, out.shape[-1]).float() * weights[..., None]).sum(dim=1).to(dtype)


def fused_experts_ref(
    x: torch.Tensor,  # [T, H]
    w13: ExpertWeight,  # [E, 2I, H]
    w2: ExpertWeight,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
    *,
    b13: torch.Tensor | None = None,  # [E, 2I], w13's row order
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SwiGLU on [gate rows; up rows]
) -> torch.Tensor:  # [T, H], x's dtype
    """Torch reference: per expert over the rows routed to it, `F.linear` in x's dtype (the
    weights dequantized to it, the biases rounded to it), the activation, `F.linear` again."""
    K = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=_shape(w13)[0]).tolist()
    rows = x[order // K]  # [T * K, H]
    out = torch.empty_like(rows)
    act_fn = _swiglu if activation is None else activation
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = slice(start, start + n)
            gate_up = F.linear(rows[seg], _expert_weight(w13, e, x.dtype), _expert_bias(b13, e, x.dtype))  # [n, 2I]
            out[seg] = F.linear(act_fn(gate_up), _expert_weight(w2, e, x.dtype), _expert_bias(b2, e, x.dtype))
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
def _weight_tile(
    w_base,  # one expert's [N_ROWS, KDIM] weights, or [N_ROWS, KDIM / 2] MXFP4 bytes
    s_base,  # one expert's [N_ROWS, KDIM / 32] MXFP4 scales (unused for float weights)
    rows,  # [BN] weight rows
    ks,  # [BK]
    mask,  # [BK, BN]
    stride_wn,
    stride_sn,
    dtype: tl.constexpr,
    FP4: tl.constexpr,
):
    """The [BK, BN] tile W[rows, ks]^T in dtype; MXFP4 codes are decoded exactly: code c is
    sign bit 3 and 4 * e2m1 = (c & 7 < 2 ? c & 7 : (c & 1) + 2) << max((c & 7) >> 1, 1), times
    the group's scale 2 ** (s - 127) built from its float32 bits (s = 0: the subnormal 2 ** -127)."""
    if FP4:
        byte = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((ks[:, None] & 1) * 4)) & 0xF  # even k: the low nibble
        mag = code & 7
        quarters = tl.where(mag < 2, mag, (mag & 1) + 2) << tl.maximum(mag >> 1, 1)  # 4 * |value|
        value = tl.where(code >= 8, -quarters, quarters).to(tl.float32) * 0.25
        s = tl.load(s_base + rows[None, :] * stride_sn + ks[:, None] // 32, mask=mask, other=127).to(tl.int32)
        scale = tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)
        tile = (value * scale).to(dtype)
    else:  # not a second return: compiled Triton would type both (uint8 bytes, float values)
        tile = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
    return tile


@triton.jit
def _expert_matmul_kernel(
    a_ptr,  # [rows, KDIM]: x (GATE_UP: row = pair // TOP_K) or the activations (row = pair)
    w_ptr,  # [E, N_ROWS, KDIM], or FP4: MXFP4 bytes [E, N_ROWS, KDIM / 2]
    scale_ptr,  # FP4: [E, N_ROWS, KDIM / 32] scale bytes
    bias_ptr,  # HAS_BIAS: [E, N_ROWS] in a's dtype
    out_ptr,  # [n_pairs, N]
    pairs_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    n_pairs,
    N,  # output columns (GATE_UP: I, with gate row c and up row c + N, or 2c and 2c + 1 if CLAMPED)
    KDIM,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_out,
    alpha,  # CLAMPED: ClampedSwiGLU's
    limit,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    CLAMPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP4: tl.constexpr,
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
    if CLAMPED:
        gate_rows = 2 * cols
        up_rows = 2 * cols + 1
    else:
        gate_rows = cols
        up_rows = cols + N
    dtype = a_ptr.dtype.element_ty
    w_base = w_ptr + expert * stride_we
    s_base = scale_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < KDIM
        w_ok = col_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptr + row[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_base, s_base, gate_rows, ks, w_ok, stride_wn, stride_sn, dtype, FP4)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w)
        if GATE_UP:
            u = _weight_tile(w_base, s_base, up_rows, ks, w_ok, stride_wn, stride_sn, dtype, FP4)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up += tl.dot(a, u)
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc += tl.load(b_base + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up += tl.load(b_base + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:  # round each projection to the activations' dtype first, as torch does
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        if CLAMPED:
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            acc = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            acc = act * up
    tl.store(out_ptr + pair[:, None] * stride_out + cols[None, :], acc.to(dtype),
             mask=valid[:, None] & col_ok[None, :])


def _launch(
    a: torch.Tensor,  # [rows, KDIM]
    w: ExpertWeight,  # [E, N_ROWS, KDIM]
    bias: torch.Tensor | None,  # [E, N_ROWS]
    out: torch.Tensor,  # [n_pairs, N]
    pairs: torch.Tensor,
    block_expert: torch.Tensor,
    *,
    top_k: int,
    gate_up: bool,
    activation: ClampedSwiGLU | None,
) -> None:
    """One `_expert_matmul_kernel` launch over every block and `BLOCK_N` columns of out."""
    fp4 = isinstance(w, Mxfp4Weight)
    values = w.blocks.contiguous() if fp4 else w.contiguous()
    scales = w.scales.contiguous() if fp4 else values
    bias = bias.to(a.dtype).contiguous() if bias is not None else None
    n_pairs, N = out.shape
    clamped = activation is not None
    _expert_matmul_kernel[(block_expert.numel(), triton.cdiv(N, BLOCK_N))](
        a, values, scales, bias if bias is not None else a, out, pairs, block_expert, n_pairs, N, a.shape[1],
        a.stride(0), values.stride(0), values.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        activation.alpha if clamped else 0.0, activation.limit if clamped else 0.0,
        TOP_K=top_k, GATE_UP=gate_up, CLAMPED=clamped, HAS_BIAS=bias is not None, FP4=fp4,
        UPCAST=dot_in_f32(a.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def fused_experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: ExpertWeight,  # [E, 2I, H]
    w2: ExpertWeight,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
    *,
    b13: torch.Tensor | None = None,  # [E, 2I], w13's row order
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SwiGLU on [gate rows; up rows]
) -> torch.Tensor:  # [T, H], x's dtype
    """Triton launcher: the gate/up kernel (bias and activation fused) into per-pair
    activations, the down kernel (bias fused) into per-pair outputs, then the weighted sum
    over k. MXFP4 weights need K a multiple of 32 (as their layout implies)."""
    T, K = ids.shape
    E, two_inter, H = _shape(w13)
    n = T * K
    if n == 0:
        return x.new_empty((0, H))
    x = x.contiguous()
    pairs, block_expert = align_by_expert(ids, E, BLOCK_M)
    act = torch.empty((n, two_inter // 2), dtype=x.dtype, device=x.device)
    out = torch.empty((n, H), dtype=x.dtype, device=x.device)
    _launch(x, w13, b13, act, pairs, block_expert, top_k=K, gate_up=True, activation=activation)
    _launch(act, w2, b2, out, pairs, block_expert, top_k=K, gate_up=False, activation=None)
    return _combine(out, weights, x.dtype)


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: ExpertWeight,  # [E, 2I, H]
    w2: ExpertWeight,  # [E, H, I]
    weights: torch.Tensor,  # [T, K] float32
    ids: torch.Tensor,  # [T, K] int
    *,
    b13: torch.Tensor | None = None,  # [E, 2I], w13's row order
    b2: torch.Tensor | None = None,  # [E, H]
    activation: ClampedSwiGLU | None = None,  # None: SwiGLU on [gate rows; up rows]
) -> torch.Tensor:  # [T, H], x's dtype
    """The experts' weighted outputs (see the module docstring)."""
    options = {"b13": b13, "b2": b2, "activation": activation}
    if use_triton(x, _storage(w13), _storage(w2), b13, b2):
        return fused_experts_triton(x, w13, w2, weights, ids, **options)
    return fused_experts_ref(x, w13, w2, weights, ids, **options)
