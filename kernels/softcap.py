"""Attention-logit soft-capping (Gemma 2): a scaled score s = q.k * sm_scale becomes
`cap * tanh(s / cap)` before the mask and the softmax, so every visible score lies in
(-cap, cap). The cap is elementwise on the scores, so attention over parts of a context
merged by log-sum-exp stays exact; masked positions are set to -inf after capping (a
capped -inf would be -cap, a visible score).

The torch paths cap explicit float32 score matrices (SDPA and the fused CPU kernel
cannot); the Triton kernels cap each tile of scores with `tanh_tile`. Attention sinks
(gpt-oss: a per-head logit that joins each softmax's denominator only) take the explicit
path too (`capped_attention` with `sinks`).
"""

from __future__ import annotations

import math

import torch

from ._triton import tl, triton

# most float32 scores `capped_attention` holds at once (64 MiB): long prompts go in row chunks
CAPPED_SCORE_ELEMENTS = 1 << 24


def check_softcap(softcap: float | None) -> None:
    """`ValueError` unless `softcap` is None (no capping) or a finite float > 0."""
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"an attention softcap is a finite number > 0, got {softcap}")


def soft_cap_(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """`softcap * tanh(scores / softcap)`, in place; returns `scores`."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def capped_attention(
    q: torch.Tensor,  # [Hq, Lq, D] float32, any strides: the last Lq tokens of the context
    k: torch.Tensor,  # [Hkv, L, D] float32, any strides
    v: torch.Tensor,  # [Hkv, L, D] float32, any strides
    *,
    sm_scale: float,
    softcap: float | None,
    window: int | None,
    attend_until: torch.Tensor | None = None,  # [Lq] int64, p + 1 <= attend_until[i] <= L
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [Hq, Lq, D] float32
    """One request's attention with its scores written out, capped by `softcap` when
    given: query row i, at position p = L - Lq + i, sees positions `0 ..= p`, or those
    below `attend_until[i]` when given (with a `window` W, only those > p - W). With
    `sinks`, query head h's softmax runs over its visible scores and one more, sinks[h]
    (neither scaled nor capped), whose column is then dropped (`softmax_with_sinks_`).
    GQA: query head h reads KV head h // (Hq // Hkv). Rows go in chunks of at most
    `CAPPED_SCORE_ELEMENTS` scores; every row sees at least its own position."""
    Hq, Lq, D = q.shape
    Hkv, L = k.shape[:2]
    G = Hq // Hkv
    qg = q.reshape(Hkv, G, Lq, D)
    head_sinks = None if sinks is None else sinks.view(Hkv, G, 1, 1)
    out = q.new_empty((Hkv, G, Lq, D))
    cols = torch.arange(L, device=q.device)  # [L]
    step = max(1, CAPPED_SCORE_ELEMENTS // (Hq * L))
    for r0 in range(0, Lq, step):
        n = min(step, Lq - r0)
        pos = torch.arange(r0, r0 + n, device=q.device)[:, None] + (L - Lq)  # [n, 1]
        hidden = cols > pos if attend_until is None else cols >= attend_until[r0 : r0 + n, None]  # [n, L]
        if window is not None:
            hidden |= cols <= pos - window
        rows = qg[:, :, r0 : r0 + n].reshape(Hkv, G * n, D)
        scores = torch.matmul(rows, k.transpose(1, 2)).mul_(sm_scale)  # [Hkv, G*n, L]
        if softcap is not None:
            soft_cap_(scores, softcap)
        masked = scores.view(Hkv, G, n, L).masked_fill_(hidden, float("-inf"))
        weights = masked.softmax(-1) if head_sinks is None else softmax_with_sinks_(masked, head_sinks)
        out[:, :, r0 : r0 + n] = torch.matmul(weights.view(Hkv, G * n, L), v).view(Hkv, G, n, D)
    return out.view(Hq, Lq, D)


def softmax_with_sinks_(
    scores: torch.Tensor,  # [..., L] float32, masked scores are -inf
    sinks: torch.Tensor,  # float32, broadcastable to [..., 1]: each row's sink logit
) -> torch.Tensor:  # [..., L], in place: `scores`
    """The softmax of each row over its scores and its sink, in place, the sink's column
    dropped: exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)), with m the larger of the
    row's peak and its sink (so that neither a large sink nor a fully masked row
    overflows). A row's weights then sum to less than 1: the sink takes the rest."""
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    weights = scores.sub_(peak).exp_()
    return weights.div_(weights.sum(dim=-1, keepdim=True).add_((sinks - peak).exp_()))


@triton.jit
def tanh_tile(x):
    """tanh of a float32 tile, through exp (the interpreter has no tanh): 1 - 2 / (e^2x + 1);
    e^2x overflowing to inf gives 1 and underflowing to 0 gives -1, never NaN."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
