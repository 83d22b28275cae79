"""Per-layer K and V buffers over the slot pool, and how many slots fit a byte budget.

A pool is float (K/V stored in the model's dtype) or quantized: K/V stored as int8 or
float8 e4m3, one float16 scale per (token, KV head) beside them, dequantized on load by
every attention path (the rule is `sprig.kernels.kv_quant`'s). The radix tree and the
allocators see slots only: they are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# `--kv-cache-dtype` -> what a pool stores: None is the model's own dtype (a float pool)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
SCALE_DTYPE = torch.float16  # a quantized pool's per (token, KV head) scales


@dataclass(frozen=True)
class KVShape:
    """The model's KV geometry: what one token costs in every layer. `dtype` is the
    model's (what attention reads); `storage` the quantized type K/V are stored as (int8
    or float8_e4m3fn, with float16 scales), None for a float pool stored in `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    storage: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        quantized = [d for d in KV_CACHE_DTYPES.values() if d is not None]
        if self.storage is not None and self.storage not in quantized:
            raise ValueError(f"storage must be None or one of {quantized}, got {self.storage}")

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    @property
    def element_dtype(self) -> torch.dtype:
        """What the K and V buffers hold."""
        return self.dtype if self.storage is None else self.storage

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers, scales included."""
        elem = torch.empty((), dtype=self.element_dtype).element_size()
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if self.quantized else 0
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * elem + scale)


def slots_for_budget(budget_bytes: int, shape: KVShape, page_size: int = 1) -> int:
    """How many usable token slots fit in `budget_bytes`, rounded down to whole pages.

    The padding slot 0 (a whole page when page_size > 1) is accounted for on top.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    total = budget_bytes // shape.bytes_per_token
    usable = total - page_size
    return max(0, usable - usable % page_size)


@dataclass(frozen=True)
class LayerKV:
    """One layer's pool buffers as the attention backends read them: K and V
    `[rows, Hkv, D]` and, in a quantized pool, their scales `[rows, Hkv]` (None in a float
    pool); `dtype` is what they dequantize to, the model's dtype."""

    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("k_scale and v_scale are given together")


class KVCache:
    """K and V buffers, each `[num_slots + page_size, num_kv_heads, head_dim]` per layer
    (`shape.element_dtype`), and in a quantized pool their scales, `k_scale` and `v_scale`,
    `[num_slots + page_size, num_kv_heads]` float16 per layer (empty lists otherwise).
    `layers[i]` bundles layer i's buffers for the attention backends.

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

        def buffers(*dims: int, dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(rows, *dims, dtype=dtype, device=self.device) for _ in range(shape.num_layers)]

        self.k = buffers(shape.num_kv_heads, shape.head_dim, dtype=shape.element_dtype)
        self.v = buffers(shape.num_kv_heads, shape.head_dim, dtype=shape.element_dtype)
        self.k_scale = buffers(shape.num_kv_heads, dtype=SCALE_DTYPE) if shape.quantized else []
        self.v_scale = buffers(shape.num_kv_heads, dtype=SCALE_DTYPE) if shape.quantized else []
        self.layers = [
            LayerKV(self.k[i], self.v[i], shape.dtype, *((self.k_scale[i], self.v_scale[i]) if shape.quantized else ()))
            for i in range(shape.num_layers)
        ]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` `[n, num_kv_heads, head_dim]` into the slots `loc` `[n]` of `layer`
        of a float pool (a quantized pool is written by `sprig.kernels.store_kv`, which
        quantizes)."""
        if self.shape.quantized:
            raise ValueError("KVCache.store writes float pools only; use sprig.kernels.store_kv")
        self.k[layer][loc] = k.to(self.shape.dtype)
        self.v[layer][loc] = v.to(self.shape.dtype)

    def nbytes(self) -> int:
        """Bytes of every buffer, scales included."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)
