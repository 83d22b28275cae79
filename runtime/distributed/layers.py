"""The tensor-parallel forms of the layers a model is wired from. Each holds its rank's
slice of the checkpoint tensors and names it: `checkpoint_index(leaf, shard)` is the index
into the full checkpoint tensor (the weight loader reads only that)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.layers.embedding import LMHead, VocabEmbedding
from sprig.runtime.layers.linear import MergedLinear
from sprig.runtime.layers.moe import FusedExperts, GptOssExperts
from sprig.runtime.model_config import MoEConfig

Index = tuple[slice, ...]


class ColumnParallelLinear(MergedLinear):
    """A `MergedLinear` holding `out_sizes[s]` rows of each shard s: checkpoint rows
    `starts[s] .. starts[s] + out_sizes[s] - 1` of its `full_sizes[s]`. Its outputs stay
    split across the ranks."""

    def __init__(self, in_features: int, out_sizes: dict[str, int], *, bias: bool, starts: dict[str, int],
                 full_sizes: dict[str, int]) -> None:
        super().__init__(in_features, out_sizes, bias=bias)
        self.starts, self.full_sizes = dict(starts), dict(full_sizes)

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        start = self.starts[shard]
        return (slice(start, start + self.out_sizes[shard]),)


class RowParallelLinear(nn.Module):
    """`y = x @ W.T + b` where x arrives split along its features: rank r holds columns
    `r * in_features .. (r + 1) * in_features - 1` of W; the partial products are summed
    over the ranks, then the (whole, replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in / tp]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # [out]

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        if leaf == "bias":
            return (slice(None),)
        start = self.group.rank * self.weight.shape[1]
        return (slice(None), slice(start, start + self.weight.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ExpertParallelSlices(FusedExperts):
    """Every expert, holding intermediate features `start .. start + I / tp - 1` of each:
    each expert's gate and up rows are column-parallel, its down columns row-parallel; the
    experts' weighted outputs are summed over the ranks (one all-reduce)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, start: int,
                 group: TPGroup) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)  # intermediate_size: this rank's
        self.start, self.group = start, group

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        features = slice(self.start, self.start + self.intermediate_size)
        return (slice(None), features) if leaf == "down_proj" else (features,)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.group.all_reduce(super().forward(x, weights, ids))


class GptOssExpertSlices(GptOssExperts):
    """gpt-oss's experts, every one holding intermediate features `start .. start + I / tp - 1`
    (`moe` is this rank's geometry): feature j's gate and up are checkpoint columns 2j and
    2j + 1 (interleaved), so a rank's gate/up columns, their biases, and in MXFP4 the rows of
    `gate_up_proj_blocks`/`_scales`, are the contiguous `2 * start ..`; its down inputs are
    rows `start ..` of the float `down_proj [E, I, H]`, or blocks `start / 32 ..` of the MXFP4
    codes and scales (so `start` and `I / tp` are whole blocks of 32). Every rank's weighted
    outputs are summed (one all-reduce); `down_proj_bias`, held whole, is added by rank 0 only."""

    def __init__(self, hidden_size: int, moe: MoEConfig, *, start: int, group: TPGroup) -> None:
        super().__init__(hidden_size, moe)
        self.start, self.features, self.group = start, moe.expert_intermediate_size, group

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        if leaf == "down_proj_bias":
            return (slice(None),)
        if leaf.startswith("gate_up_proj"):
            columns = slice(2 * self.start, 2 * (self.start + self.features))
            return (slice(None), slice(None), columns) if leaf == "gate_up_proj" else (slice(None), columns)
        if leaf == "down_proj":
            return (slice(None), slice(self.start, self.start + self.features))
        g = self.MXFP4_GROUP  # down_proj_blocks [E, H, I / 32, 16], down_proj_scales [E, H, I / 32]
        return (slice(None), slice(None), slice(self.start // g, (self.start + self.features) // g))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
                down_bias: bool = True) -> torch.Tensor:  # [T, H]
        part = super().forward(x, weights, ids, down_bias=down_bias and self.group.rank == 0)
        return self.group.all_reduce(part)


class QueryHeadRows:
    """`checkpoint_index` of a module's own per-query-head parameters (gpt-oss's attention
    `sinks [Hq]`): rows `start .. start + count - 1`, this rank's q heads."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count = start, count

    def __call__(self, leaf: str, shard: str | None) -> Index:
        return (slice(self.start, self.start + self.count),)


class VocabParallelEmbedding(VocabEmbedding):
    """Rows `start .. start + rows - 1` of the embedding; a token outside them contributes
    zeros here, so the sum over the ranks is every token's row."""

    def __init__(self, rows: int, hidden_size: int, *, start: int, group: TPGroup) -> None:
        super().__init__(rows, hidden_size)
        self.start, self.group = start, group

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        return (slice(self.start, self.start + self.weight.shape[0]),)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T]
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside[:, None], 0))


class VocabParallelLMHead(LMHead):
    """The logits of this rank's vocabulary rows (the same rows as the embedding's, whose
    weight a tied head uses), gathered from every rank into the whole vocabulary:
    `sizes[r]` rows per rank r in rank order; shorter slices are padded for the gather."""

    def __init__(self, sizes: list[int], hidden_size: int, *, tied: bool, group: TPGroup) -> None:
        super().__init__(sizes[group.rank], hidden_size, tied=tied)  # weight [V / tp, H]
        self.group, self.sizes = group, sizes
        self.start = sum(sizes[: group.rank])
        self.register_buffer("keep", torch.empty(sum(sizes), dtype=torch.int64), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute `keep`, the gathered columns that are real rows, on its device."""
        if self.keep.is_meta:
            return
        width = max(self.sizes)
        self.keep = torch.tensor(
            [r * width + i for r, n in enumerate(self.sizes) for i in range(n)], device=self.keep.device
        )

    def checkpoint_index(self, leaf: str, shard: str | None) -> Index:
        return (slice(self.start, self.start + self.sizes[self.group.rank]),)

    def forward(
        self,
        hidden: torch.Tensor,  # [R, H]
        embedding: VocabEmbedding,
    ) -> torch.Tensor:  # [R, V] float32
        logits = super().forward(hidden, embedding)  # [R, V / tp]
        logits = F.pad(logits, (0, max(self.sizes) - logits.shape[1]))
        gathered = self.group.all_gather(logits)  # [R, tp * max(sizes)]
        return gathered if len(set(self.sizes)) == 1 else gathered[:, self.keep]
