"""The quantized linear layer: the one interface every format and kernel meets behind."""

from __future__ import annotations

import torch
from torch import nn

from sprig.runtime.layers.linear import shard_slice
from sprig.runtime.quantization.formats.base import WeightFormat
from sprig.runtime.quantization.matmul import build_matmul
from sprig.runtime.quantization.weight import QuantizedWeight, QuantScheme

PIECES = ("qweight", "scales", "zeros")  # what every shard must provide


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ b)` for a quantized W whose output rows are the shards `out_sizes`
    stacked in order (fused q/k/v, gate/up; one shard named None for a plain layer).

    Built empty. `load(leaf, shard, tensor)` takes each checkpoint tensor of the format and
    stages its canonical pieces on the CPU; `finalize(dtype, device)`, once every shard's
    tensors are in, builds the weight, reorders act-order columns (then every forward
    reorders x the same way), and hands it to the device's matmul (`build_matmul`).
    Shards of an act-order layer must share one g_idx (they do in GPTQ checkpoints: fused
    projections see the same inputs). `forward` before `finalize` is an error.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: dict[str | None, int],
        *,
        bias: bool,
        scheme: QuantScheme,
        fmt: WeightFormat,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = dict(out_sizes)
        self.out_features = sum(self.out_sizes.values())
        self.scheme, self.fmt = scheme, fmt
        self.num_groups = scheme.num_groups(in_features)
        required, optional = fmt.leaves(scheme)
        self.required_leaves = required | {"bias"} if bias else required
        self.optional_leaves = optional
        self._staged: dict[str, torch.Tensor] = {}
        self._filled: set[tuple[str, str | None]] = set()
        self._g_idx: torch.Tensor | None = None
        self.matmul: nn.Module | None = None
        self.register_buffer("perm", None)  # [K] int64: input order of act-order columns
        self.register_buffer("bias", None)  # [N]

    def shard_rows(self, name: str | None) -> slice:
        """The output rows that shard `name` occupies."""
        return shard_slice(self.out_sizes, name)

    def load(self, leaf: str, shard: str | None, tensor: torch.Tensor) -> None:
        """Stage checkpoint tensor `leaf` of `shard`; ValueError if it does not fit."""
        rows = self.shard_rows(shard)
        size = rows.stop - rows.start
        if leaf == "bias":
            if tuple(tensor.shape) != (size,):
                raise ValueError(f"bias has shape {list(tensor.shape)}, the layer expects {[size]}")
            pieces = {"bias": tensor}
        else:
            pieces = self.fmt.convert(leaf, tensor, self.scheme, size, self.in_features)
        self.stage(pieces, shard)

    def stage_shard(self, pieces: dict[str, torch.Tensor], shard: str | None) -> None:
        """Stage this layer's rows of canonical pieces that hold all of `shard` (every
        row here; a tensor-parallel layer keeps its own, `ColumnParallelQuantizedLinear`)."""
        self.stage(pieces, shard)

    def stage(self, pieces: dict[str, torch.Tensor], shard: str | None) -> None:
        """Stage canonical pieces (`QuantizedWeight`'s, "g_idx", "bias") of `shard`."""
        rows = self.shard_rows(shard)
        for piece, value in pieces.items():
            if piece == "g_idx":
                self._stage_g_idx(value)
                continue
            if (piece, shard) in self._filled:
                raise ValueError(f"the {piece} of shard {shard!r} are already loaded")
            staged = self._staged.get(piece)
            if staged is None:
                staged = torch.empty((self.out_features, *value.shape[1:]), dtype=value.dtype)
                self._staged[piece] = staged
            staged[rows] = value
            self._filled.add((piece, shard))

    def _stage_g_idx(self, g_idx: torch.Tensor) -> None:
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= self.num_groups):
            raise ValueError(f"g_idx names groups outside 0 .. {self.num_groups - 1}")
        if self._g_idx is not None and not torch.equal(self._g_idx, g_idx):
            raise ValueError("the fused shards of this layer have different g_idx")
        self._g_idx = g_idx

    def finalize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Build the weight on `device`, activations in `dtype`; drops the staged pieces."""
        missing = [(p, s) for p in PIECES for s in self.out_sizes if (p, s) not in self._filled]
        if missing:
            raise ValueError(f"quantized layer is missing {missing}")
        staged = self._staged
        weight = QuantizedWeight(
            staged["qweight"], staged["scales"], staged["zeros"], self.scheme.bits, self._g_idx, self.scheme.float8
        )
        weight, perm = weight.with_adjacent_groups()
        self.matmul = build_matmul(weight, dtype, device)
        self.perm = None if perm is None else perm.to(device)
        self.bias = staged["bias"].to(dtype=dtype, device=device) if "bias" in staged else None
        self.discard_staged()

    def discard_staged(self) -> None:
        """Forget the pieces staged so far (a load that failed part-way; the next starts over)."""
        self._staged, self._filled, self._g_idx = {}, set(), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.matmul is None:
            raise RuntimeError("QuantizedLinear used before finalize()")
        x2 = x.reshape(-1, self.in_features)  # [T, K]
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y = self.matmul(x2)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
