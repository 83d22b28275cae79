"""A linear layer whose output rows are several checkpoint tensors stacked (fused q/k/v,
fused gate/up): one matmul, loaded by slicing each checkpoint tensor into its rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """`y = x @ W.T (+ b)`, with W `[sum(out_sizes), in_features]` = the shards stacked in
    `out_sizes` order. `shard_rows(name)` is where checkpoint tensor `name` goes."""

    def __init__(self, in_features: int, out_sizes: dict[str, int], *, bias: bool) -> None:
        super().__init__()
        self.out_sizes = dict(out_sizes)
        total = sum(self.out_sizes.values())
        self.weight = nn.Parameter(torch.empty(total, in_features))  # [N, in]
        self.bias = nn.Parameter(torch.empty(total)) if bias else None  # [N]

    def shard_rows(self, name: str) -> slice:
        """The rows (dim 0 of weight and bias) that hold shard `name`."""
        return shard_slice(self.out_sizes, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, N]
        return F.linear(x, self.weight, self.bias)


def shard_slice(out_sizes: Mapping[str | None, int], name: str | None) -> slice:
    """The output rows of shard `name` when shards of `out_sizes` rows are stacked in order."""
    start = 0
    for shard, size in out_sizes.items():
        if shard == name:
            return slice(start, start + size)
        start += size
    raise KeyError(f"no shard {name!r} in {list(out_sizes)}")
