"""What one tensor-parallel rank holds of an adapted linear layer, so that it holds the
matching part of each LoRA module (`A [r, in]`, `B [out, r]`):

- a column-parallel layer (q/k/v, gate/up) holds rows of each output shard, the same rows
  as its weight's (`starts`, the KV heads replicated where the base weight's are): the
  rank keeps A whole and those rows of B;
- a row-parallel layer (o, down) holds the input columns of its rank: the rank keeps those
  columns of A and B whole. `x_shard @ A_shard.T` is then a partial sum over the ranks,
  which `group` adds up before B (see `LoRALayer`);
- any other layer (no tensor parallelism) holds everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.layers import RowParallelLinear
from sprig.runtime.distributed.quantized import RowParallelQuantizedLinear


@dataclass(frozen=True)
class LayerSplit:
    """A layer of `full_in` inputs and, per output shard, `full_out[s]` rows (in row order),
    of which this rank holds inputs `columns` and rows `rows[s]` of each shard. `group`:
    the group a row-parallel layer sums its partial products over, else None."""

    full_in: int
    columns: slice
    full_out: dict[str | None, int]
    rows: dict[str | None, slice]
    group: TPGroup | None = None

    @property
    def out_sizes(self) -> dict[str | None, int]:
        """This rank's rows of each shard."""
        return {s: r.stop - r.start for s, r in self.rows.items()}


def layer_split(layer: nn.Module) -> LayerSplit:
    """`layer`'s split (a float or quantized `nn.Linear`, `MergedLinear` or their
    tensor-parallel forms)."""
    local_in = getattr(layer, "in_features", None) or layer.weight.shape[1]
    out = dict(layer.out_sizes) if hasattr(layer, "out_sizes") else {None: layer.weight.shape[0]}
    if hasattr(layer, "starts"):  # column-parallel, float or quantized: the rows its weight loads
        rows = {s: slice(layer.starts[s], layer.starts[s] + n) for s, n in out.items()}
        return LayerSplit(local_in, slice(0, local_in), dict(layer.full_sizes), rows)
    whole_rows = {s: slice(0, n) for s, n in out.items()}
    if isinstance(layer, RowParallelLinear):
        columns = layer.checkpoint_index("weight", None)[1]
        return LayerSplit(local_in * layer.group.size, columns, out, whole_rows, layer.group)
    if isinstance(layer, RowParallelQuantizedLinear):
        return LayerSplit(layer.full_in, layer.columns, out, whole_rows, layer.group)
    return LayerSplit(local_in, slice(0, local_in), out, whole_rows)
