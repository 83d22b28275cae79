"""Attention that also returns the log-sum-exp of its scaled scores, in float32: the
torch paths that attend to parts of a context separately (a shared prefix, then each
request's remainder) merge the parts by it.

Grouped-query attention folds a KV head's query heads into query rows, so every path sees
one KV head per query head. On the CPU, torch's fused flash-attention kernel runs when
there are at least `FLASH_MIN_ROWS` query rows per head: it never materialises the
scores and parallelises over batch, heads and query blocks. With fewer rows (a decode
step's few query heads per KV head) its blocked loop costs more than the explicit product,
which every other case runs.
"""

from __future__ import annotations

import torch

FLASH_MIN_ROWS = 5  # on the CPU, 2 rows x 62 keys: explicit 0.79 ms, flash 0.94 ms (128 x 4 heads)
# exp of a float32 below about -87 is subnormal or 0, which torch's vectorized CPU exp
# computes several times slower (-inf 8x, -100 60x): the explicit path clamps the scores
# there, so a score that far below its row's peak (or masked) weighs exp(-87) ~ 1.6e-38
# instead of less, below float32 resolution beside the peak's weight of 1.
EXP_FLOOR = -87.0


def attention_lse(
    q: torch.Tensor,  # [N, H, M, D]
    k: torch.Tensor,  # [N, H, L, D], any strides
    v: torch.Tensor,  # [N, H, L, D], any strides
    *,
    scale: float,
    valid: torch.Tensor | None = None,  # bool, broadcastable to [N, H, M, L]; None: all
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H, M, D], [N, H, M] float32
    """softmax(q k^T * scale, masked by `valid`) v and the rows' log-sum-exp, computed in
    float32. Every row must have a valid key (a row without one has no finite result).
    A masked key may weigh up to exp(EXP_FLOOR) instead of 0: its K and V must be finite
    and of ordinary size (padding repeats real slots, or is zeros)."""
    q, k, v = q.float(), k.float(), v.float()
    bias = None if valid is None else torch.where(valid, 0.0, float("-inf")).float()  # additive mask
    if q.device.type == "cpu" and q.shape[2] >= FLASH_MIN_ROWS:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [N, H, M, L]
    if bias is not None:
        scores.add_(bias)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).clamp_min_(EXP_FLOOR).exp_()
    sums = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(sums), sums.log_().add_(peak).squeeze(-1)
