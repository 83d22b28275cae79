"""OLMo's q and k norms under tensor parallelism: one RMSNorm over a whole projection
(every head's features at once), of which each rank holds some heads."""

from __future__ import annotations

import torch
from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.layers import Index


class HeadParallelRMSNorm(nn.Module):
    """OLMo's RMSNorm (scaled in float32, rounded once) over a projection split by heads:
    this rank holds features `start .. start + size - 1` and that slice of the weight.
    Each token's sum of squares is summed over the ranks (one all-reduce) and divided by
    `size * group.size`; every rank then scales its own features.

    Invariant: every rank holds `size` features and every feature is held by the same
    number of ranks (one, or `n / Hkv` for a KV head replicated on that many ranks, all
    holding equal values), so that divisor is the replicas times the projection's width
    and the mean counts each feature once."""

    def __init__(self, size: int, eps: float, *, start: int, group: TPGroup) -> None:
        super().__init__()
        self.eps, self.start, self.group = eps, start, group
        self.count = size * group.size
        self.weight = nn.Parameter(torch.empty(size))  # [size]

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        return (slice(self.start, self.start + self.weight.shape[0]),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, size] -> [T, size]
        h = x.float()
        squares = self.group.all_reduce(h.pow(2).sum(-1, keepdim=True))  # [T, 1], over every rank's features
        scale = squares.div_(self.count).add_(self.eps).rsqrt_()  # [T, 1]
        return (h * scale * self.weight.float()).to(x.dtype)
