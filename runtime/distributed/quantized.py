"""Quantized layers split like float ones. Each checkpoint tensor is converted whole into
the canonical pieces (`QuantizedWeight`: codes `[N, K]`, scales and zero points `[N, G]`),
then cut: a column-parallel layer keeps its rows of every shard, a row-parallel one its
input columns and their groups. The codes and scales are those of the whole layer, so an
online format (which quantizes as it loads) rounds every weight as one rank would."""

from __future__ import annotations

import torch
from torch import nn

from sprig.runtime.distributed.layers import ColumnParallelLinear, RowParallelLinear
from sprig.runtime.quantization.formats.base import WeightFormat
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.quantization.weight import QuantScheme


class ColumnParallelQuantizedLinear(QuantizedLinear):
    """A `ColumnParallelLinear`'s rows of each shard, quantized."""

    def __init__(self, layer: ColumnParallelLinear, fmt: WeightFormat, scheme: QuantScheme) -> None:
        super().__init__(layer.weight.shape[1], layer.out_sizes, bias=layer.bias is not None, scheme=scheme, fmt=fmt)
        self.starts, self.full_sizes = layer.starts, layer.full_sizes

    def load(self, leaf: str, shard: str | None, tensor: torch.Tensor) -> None:
        if leaf == "bias":
            super().load(leaf, shard, tensor[self._rows(shard)])
            return
        self.stage_shard(self.fmt.convert(leaf, tensor, self.scheme, self.full_sizes[shard], self.in_features), shard)

    def stage_shard(self, pieces: dict[str, torch.Tensor], shard: str | None) -> None:
        """Stage this rank's rows of canonical pieces that hold all of `shard` (every
        rank's `full_sizes[shard]` rows; a g_idx whole)."""
        rows = self._rows(shard)
        self.stage({k: v if k == "g_idx" else v[rows] for k, v in pieces.items()}, shard)

    def _rows(self, shard: str | None) -> slice:
        return slice(self.starts[shard], self.starts[shard] + self.out_sizes[shard])


class RowParallelQuantizedLinear(QuantizedLinear):
    """A `RowParallelLinear` quantized: this rank's input columns (whole groups of them)
    times x's slice, summed over the ranks, then the bias once."""

    def __init__(self, layer: RowParallelLinear, fmt: WeightFormat, scheme: QuantScheme) -> None:
        out_features, in_features = layer.weight.shape
        super().__init__(in_features, {None: out_features}, bias=layer.bias is not None, scheme=scheme, fmt=fmt)
        self.group = layer.group
        self.columns = slice(layer.group.rank * in_features, (layer.group.rank + 1) * in_features)
        self.full_in = in_features * layer.group.size
        self.row_bias: torch.Tensor | None = None

    def load(self, leaf: str, shard: str | None, tensor: torch.Tensor) -> None:
        if leaf == "bias":
            super().load(leaf, shard, tensor)
            return
        pieces = self.fmt.convert(leaf, tensor, self.scheme, self.out_features, self.full_in)
        g_idx = pieces.pop("g_idx", None)
        if g_idx is not None and g_idx.numel():
            size = self.full_in // self.scheme.num_groups(self.full_in)
            if not torch.equal(g_idx, torch.arange(self.full_in, device=g_idx.device) // size):
                raise ValueError("act-order (g_idx) layers are not split by input across tensor-parallel ranks")
        cut = {}
        for name, value in pieces.items():
            if name == "qweight":
                cut[name] = value[:, self.columns]
            elif name in ("scales", "zeros") and value.shape[1] > 1:  # one group per column range
                size = self.full_in // value.shape[1]
                if self.columns.start % size or self.in_features % size:
                    raise ValueError(f"groups of {size} inputs do not split over the ranks' {self.in_features}")
                cut[name] = value[:, self.columns.start // size : self.columns.stop // size]
            else:
                cut[name] = value
        self.stage(cut, shard)

    def finalize(self, dtype: torch.dtype, device: torch.device) -> None:
        super().finalize(dtype, device)
        self.row_bias, self.bias = self.bias, None  # added after the sum, not by every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K / tp] -> [T, N]
        y = self.group.all_reduce(super().forward(x))
        return y if self.row_bias is None else y + self.row_bias


def install_split_quantized(model: nn.Module, fmt: WeightFormat) -> None:
    """Replace the split linear layers that `fmt` quantizes with empty quantized ones (the
    loader fills and finalizes them); ValueError naming a fused layer whose checkpoint
    layers `fmt` quantizes differently."""
    hf_parts = {v: k for k, v in model.packed_modules.items()}
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, ColumnParallelLinear):
            schemes = {fmt.scheme_for(f"{parent}.{hf_parts[(leaf, s)]}") for s in module.out_sizes}
            if len(schemes) > 1:
                raise ValueError(f"{name}: its fused layers are quantized differently ({fmt.name})")
            scheme = schemes.pop()
            layer = None if scheme is None else ColumnParallelQuantizedLinear(module, fmt, scheme)
        elif isinstance(module, RowParallelLinear):
            scheme = fmt.scheme_for(name)
            try:
                layer = None if scheme is None else RowParallelQuantizedLinear(module, fmt, scheme)
            except ValueError as e:
                raise ValueError(f"{name}: split over the tensor-parallel ranks, {e}") from None
        else:
            continue
        if layer is not None:
            setattr(model.get_submodule(parent), leaf, layer)
