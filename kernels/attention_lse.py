"""Attention that also returns the log-sum-exp of its scaled scores, in float32: the
torch paths that attend to parts of a context separately (a shared prefix, then each
request's remainder) merge the parts by it.

Grouped-query attention folds a KV head's query heads into query rows, so every path sees
one KV head per query head. On the CPU, torch's fused flash-attention kernel runs for any
number of rows: it reads each row's K/V once, never materialises the scores and
parallelises over batch, heads and query blocks. Elsewhere (the torch backend on CUDA),
and wherever the scores are soft-capped (the fused kernel cannot cap), the explicit
product runs. Attention sinks join once a row's parts are merged (`add_sinks_`): a sink
adds to the whole softmax's denominator, not to each part's.
"""

from __future__ import annotations

import torch

from .softcap import soft_cap_


def attention_lse(
    q: torch.Tensor,  # [N, H, M, D]
    k: torch.Tensor,  # [N, H, L, D], any strides
    v: torch.Tensor,  # [N, H, L, D], any strides
    *,
    scale: float,
    valid: torch.Tensor | None = None,  # bool, broadcastable to [N, H, M, L]; None: all
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H, M, D], [N, H, M] float32
    """softmax(q k^T * scale, capped by `softcap` (when given), masked by `valid`) v and the
    rows' log-sum-exp of those scores, computed in float32. Every row must have a valid
    key (a row without one has no finite result)."""
    q, k, v = q.float(), k.float(), v.float()
    bias = None if valid is None else torch.where(valid, 0.0, float("-inf")).float()  # additive mask
    if q.device.type == "cpu" and softcap is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
    return explicit_attention_lse(q, k, v, scale=scale, bias=bias, softcap=softcap)


def explicit_attention_lse(
    q: torch.Tensor,  # [N, H, M, D] float32
    k: torch.Tensor,  # [N, H, L, D] float32, any strides
    v: torch.Tensor,  # [N, H, L, D] float32, any strides
    *,
    scale: float,
    bias: torch.Tensor | None = None,  # float32 0 / -inf, broadcastable to [N, H, M, L]
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H, M, D], [N, H, M] float32
    """`attention_lse` as one score matrix per head: the path off the CPU and for capped
    scores (capped before the bias, so masked scores stay -inf)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [N, H, M, L]
    if softcap is not None:
        soft_cap_(scores, softcap)
    if bias is not None:
        scores.add_(bias)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).exp_()
    sums = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(sums), sums.log_().add_(peak).squeeze(-1)


def add_sinks_(
    out: torch.Tensor,  # [..., H, D] float32: rows' attention output, merged over all their parts
    lse: torch.Tensor,  # [..., H] float32: those rows' log-sum-exp L (-inf for a row that saw nothing)
    sinks: torch.Tensor,  # [H] float32: each head's sink logit s
) -> torch.Tensor:  # [..., H, D], in place: `out`
    """Give each row's softmax its head's sink: the denominator exp(L) becomes
    exp(L) + exp(s) and the sink weighs no value, so the output scales by
    exp(L) / (exp(L) + exp(s)) = sigmoid(L - s). Call once per row, with L over the
    row's whole context (after every log-sum-exp merge); a row that saw nothing stays 0."""
    return out.mul_(torch.sigmoid(lse - sinks).unsqueeze(-1))
