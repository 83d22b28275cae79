"""Attention that also returns the log-sum-exp of its scaled scores, in float32: the
torch paths that attend to parts of a context separately (a shared prefix, then each
request's remainder) merge the parts by it.

On the CPU this is torch's fused flash-attention kernel, which never materialises the
scores and parallelises over batch, heads and query blocks; elsewhere it is the explicit
product. Grouped-query attention folds a KV head's query heads into query rows, so both
paths see one KV head per query head.
"""

from __future__ import annotations

import torch


def attention_lse(
    q: torch.Tensor,  # [N, H, M, D]
    k: torch.Tensor,  # [N, H, L, D], any strides
    v: torch.Tensor,  # [N, H, L, D], any strides
    *,
    scale: float,
    valid: torch.Tensor | None = None,  # bool, broadcastable to [N, H, M, L]; None: all
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H, M, D], [N, H, M] float32
    """softmax(q k^T * scale, masked by `valid`) v and the rows' log-sum-exp, computed in
    float32. Every row must have a valid key (a row without one has no finite result)."""
    q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu":
        mask = None
        if valid is not None:
            mask = torch.zeros(valid.shape, dtype=torch.float32, device=q.device)
            mask.masked_fill_(~valid, float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [N, H, M, L]
    if valid is not None:
        scores.masked_fill_(~valid, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).exp_()
    sums = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(sums), sums.log_().add_(peak).squeeze(-1)
