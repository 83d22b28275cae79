"""The KV slot allocator: a free list of slot indices, handed out in whole pages."""

from __future__ import annotations

import torch


class AllocatorError(RuntimeError):
    """A double free or a foreign index, caught by an allocator in check mode."""


class SlotAllocator:
    """Hands out KV slot indices of a pool of `num_slots` usable slots.

    Slots are grouped in pages of `page_size`; page 0 (slots `0 .. page_size-1`) is the
    padding page and is never handed out, so usable slots are
    `page_size .. page_size + num_slots - 1`.

    Invariants:
    - `alloc(n)` returns exactly `n` slots (whole pages, each page's slots consecutive)
      or `None`; never a partial allocation.
    - `free(indices)` returns the pages that contain `indices` to the free list; with
      `page_size > 1` freeing any slot of a page frees the whole page, once.
    - With `check=True`, freeing a free page or an index outside the pool raises
      `AllocatorError` (and changes nothing).
    """

    def __init__(self, num_slots: int, page_size: int = 1, *, check: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0 or num_slots % page_size:
            raise ValueError(
                f"num_slots must be a non-negative multiple of page_size={page_size}, got {num_slots}"
            )
        self.size = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.check = check
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        """Every usable page is free again."""
        self._free = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._released_count = 0
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._page_free[0] = False

    def available(self) -> int:
        """Free slots (always a multiple of page_size)."""
        return (self._free.numel() + self._released_count) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` slot indices (int64), or None if fewer than `n` are free.

        With `page_size > 1`, `n` must be a multiple of the page size.
        """
        if n < 0 or n % self.page_size:
            raise ValueError(f"alloc size must be a non-negative multiple of {self.page_size}, got {n}")
        pages_needed = n // self.page_size
        if pages_needed > self._free.numel():
            if pages_needed > self._free.numel() + self._released_count:
                return None
            self._merge_released()
        pages = self._free[:pages_needed]
        self._free = self._free[pages_needed:]
        if self.check:
            self._page_free[pages] = False
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return the pages holding `indices` to the pool (see the class invariants)."""
        if indices.numel() == 0:
            return
        indices = indices.to(torch.int64).reshape(-1)
        pages = indices if self.page_size == 1 else torch.unique(indices // self.page_size)
        if self.check:
            self._check_free(indices, pages)
            self._page_free[pages] = True
        self._released.append(pages)
        self._released_count += pages.numel()

    def _check_free(self, indices: torch.Tensor, pages: torch.Tensor) -> None:
        lo, hi = self.page_size, self.page_size * (self.num_pages + 1)
        foreign = indices[(indices < lo) | (indices >= hi)]
        if foreign.numel():
            raise AllocatorError(f"foreign slot indices (pool is [{lo}, {hi})): {foreign[:8].tolist()}")
        if self.page_size == 1 and torch.unique(pages).numel() != pages.numel():
            raise AllocatorError("the same slot appears twice in one free()")
        already = pages[self._page_free[pages]]
        if already.numel():
            slots = (already * self.page_size).tolist()[:8]
            raise AllocatorError(f"double free of the page(s) starting at slot(s) {slots}")

    def _merge_released(self) -> None:
        self._free = torch.cat([self._free, *self._released])
        self._released = []
        self._released_count = 0
