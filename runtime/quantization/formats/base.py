"""What a quantized checkpoint format provides: which linear layers it quantizes and how,
which tensors each one stores, and how each tensor turns into the canonical pieces of a
`QuantizedWeight` (see `sprig.runtime.quantization.weight`).

Pieces, for a shard of `rows` output rows of a layer with `cols` inputs: "qweight" uint8
`[rows, cols]` codes, "scales" and "zeros" float32 `[rows, groups]`, "g_idx" int64
`[cols]` (only for act-order checkpoints). A format converts one checkpoint tensor at a
time, so a shard's tensors may arrive in any order and from any file.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sprig.runtime.quantization.weight import QuantScheme


class WeightFormat(Protocol):
    name: str  # as config.json's quant_method spells it, or the online scheme's name

    def scheme_for(self, module: str) -> QuantScheme | None:
        """The scheme of the linear layer with this checkpoint name (e.g.
        "model.layers.0.self_attn.q_proj"), or None if it is stored in float."""
        ...

    def leaves(self, scheme: QuantScheme) -> tuple[frozenset[str], frozenset[str]]:
        """(required, optional) tensor names under a quantized layer, e.g. "qweight"."""
        ...

    def convert(
        self, leaf: str, tensor: torch.Tensor, scheme: QuantScheme, rows: int, cols: int
    ) -> dict[str, torch.Tensor]:
        """The canonical pieces that checkpoint tensor `leaf` of a shard holds; ValueError
        (naming the leaf and the shapes) if its shape or dtype is not the format's."""
        ...


def expect(tensor: torch.Tensor, leaf: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """ValueError unless `tensor` has this shape (and dtype)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{leaf} has shape {list(tensor.shape)}, the format expects {list(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{leaf} has dtype {tensor.dtype}, the format stores {dtype}")


def packed_count(count: int, bits: int, leaf: str) -> int:
    """int32 words holding `count` codes of `bits` bits; ValueError if they do not fill words."""
    per_word = 32 // bits
    if count % per_word:
        raise ValueError(f"{leaf}: {count} codes do not fill whole int32 words of {per_word}")
    return count // per_word


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed `32 // bits` to an int32 along `dim`, the lowest bits first: element
    i * (32 // bits) + j of the result is bits [j * bits, (j + 1) * bits) of word i."""
    per_word = 32 // bits
    mask = (1 << bits) - 1
    words = packed.to(torch.int32).movedim(dim, -1)
    parts = [(words >> (j * bits)) & mask for j in range(per_word)]
    codes = torch.stack(parts, -1).reshape(*words.shape[:-1], words.shape[-1] * per_word)
    return codes.movedim(-1, dim)
