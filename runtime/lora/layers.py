"""Applying many LoRA adapters in one batch: each token gets its own adapter's delta.

Every adapted linear layer holds all `S` adapter slots stacked: `a [S * n * R, in]` (each
slot's `A` of each of the layer's n shards, padded to rank R with zero rows) and
`b [out, S * n * R]` (each shard's `scale * B` in its output rows and its slot's columns,
zeros elsewhere). A step computes, after the layer's own output `y`,

    y + ((x @ a.T) masked to the columns of each token's slot) @ b.T

The masked entries are exact zeros, so a token's delta is its own adapter's alone,
whatever the other tokens use, and a token without an adapter (slot -1) gets exactly `y`.
One matmul pair per layer, whatever the mix of adapters: no grouping by adapter, no host
sync. The delta runs as a forward hook on the layer, so parameter names do not change.

Under tensor parallelism each rank holds its part of every slot (`split.LayerSplit`): a
column-parallel layer's rows of `b`, a row-parallel layer's input columns of `a`. For a
row-parallel layer `x @ a.T` is then a partial sum, all-reduced over the ranks (a
`[T, S * n * R]` tensor, small beside the layer's own `[T, out]`) before every rank applies
the whole `b` to it: each rank adds the same delta to the layer's already summed output,
which is the unsplit layer's delta up to the order of the float additions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from sprig.runtime.lora.split import LayerSplit


class LoRATokens:
    """What the adapted layers of one model read during a forward pass: each token's slot
    (`[T]` int64 on the model's device, -1 for none), or None when no token of the step
    has an adapter (the layers then add nothing)."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


class LoRALayer:
    """The stacked adapter slots of one linear layer, split as `split` says (output shards
    in row order: `{None: out}` for an unfused layer). `write` and `check` take each
    module's whole `(A, scale * B)`; the layer keeps this rank's part."""

    def __init__(self, layer: nn.Module, split: LayerSplit, *, slots: int, rank: int, tokens: LoRATokens,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.split = split
        self.out_sizes = split.out_sizes
        self.shards = list(self.out_sizes)
        self.rank, self.tokens = rank, tokens
        width = slots * len(self.shards) * rank
        in_features = split.columns.stop - split.columns.start
        self.a = torch.zeros(slots, len(self.shards), rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(sum(self.out_sizes.values()), slots, len(self.shards), rank, dtype=dtype, device=device)
        self.column_slot = torch.arange(slots, device=device).repeat_interleave(width // slots)  # [S * n * R]
        self.handle: RemovableHandle = layer.register_forward_hook(self._add_delta)

    def write(self, slot: int, modules: Mapping[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's `(A, scale * B)` per shard in `slot`, this rank's part of each
        (shards it does not adapt, and the rank past each A's, stay zero)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        start = 0
        for i, shard in enumerate(self.shards):
            rows = self.out_sizes[shard]
            if shard in modules:
                a, b = modules[shard]
                self.a[slot, i, : a.shape[0]] = a[:, self.split.columns].to(self.a.dtype)
                self.b[start : start + rows, slot, i, : b.shape[1]] = b[self.split.rows[shard]].to(self.b.dtype)
            start += rows

    def check(self, slot: int, modules: Mapping[str | None, tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
        """ValueError naming `what` unless `write(slot, modules)` fits this layer (checked
        against the whole layer's geometry, which every rank shares)."""
        full_in = self.split.full_in
        for shard, (a, b) in modules.items():
            if shard not in self.out_sizes:
                raise ValueError(f"{what}: no shard {shard!r} in this layer")
            if a.shape[0] > self.rank:
                raise ValueError(f"{what}: rank {a.shape[0]} exceeds max_lora_rank {self.rank}")
            if a.shape[1] != full_in or b.shape[0] != self.split.full_out[shard]:
                raise ValueError(f"{what}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit a layer of "
                                 f"{full_in} inputs and {self.split.full_out[shard]} outputs")

    def _add_delta(self, layer: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        slots = self.tokens.slots
        if slots is None:
            return y
        x = args[0]  # [T, in] (a row-parallel layer's: this rank's inputs)
        xa = F.linear(x, self.a.view(-1, self.a.shape[-1]))  # [T, S * n * R]
        xa = xa.masked_fill(self.column_slot[None, :] != slots[:, None], 0.0)
        if self.split.group is not None:  # partial over the ranks' inputs: summed before b
            xa = self.split.group.all_reduce(xa)
        return y + F.linear(xa, self.b.view(self.b.shape[0], -1))
