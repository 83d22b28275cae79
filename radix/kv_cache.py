"""Per-layer K and V buffers over the slot pool, and how many slots fit a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """The model's KV geometry: what one token costs in every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def slots_for_budget(budget_bytes: int, shape: KVShape, page_size: int = 1) -> int:
    """How many usable token slots fit in `budget_bytes`, rounded down to whole pages.

    The padding slot 0 (a whole page when page_size > 1) is accounted for on top.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    total = budget_bytes // shape.bytes_per_token
    usable = total - page_size
    return max(0, usable - usable % page_size)


class KVCache:
    """K and V buffers, each `[num_slots + page_size, num_kv_heads, head_dim]` per layer.

    Row 0 (the first page) is the padding slot: it is never handed out, so writes
    to it by padded batch entries are harmless.
    """

    def __init__(
        self, shape: KVShape, num_slots: int, *, page_size: int = 1, device: str | torch.device = "cpu"
    ) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.page_size = page_size
        self.device = torch.device(device)
        rows = num_slots + page_size
        self.k = [
            torch.zeros(rows, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        self.v = [
            torch.zeros(rows, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` `[n, num_kv_heads, head_dim]` into the slots `loc` `[n]` of `layer`."""
        self.k[layer][loc] = k.to(self.shape.dtype)
        self.v[layer][loc] = v.to(self.shape.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
