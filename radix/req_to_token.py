"""The request-to-token table: row r holds the KV slot index of every token of request r."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """An int32 table `[max_running_requests, max_context_len]` with row allocation.

    Invariant: a row is owned by at most one running request between `alloc()` and
    `free(row)`; its contents are meaningful only up to that request's length.
    """

    def __init__(self, max_running_requests: int, max_context_len: int, *, device: str = "cpu") -> None:
        if max_running_requests < 1 or max_context_len < 1:
            raise ValueError(
                "max_running_requests and max_context_len must be >= 1, got "
                f"{max_running_requests} and {max_context_len}"
            )
        self.size = max_running_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros(max_running_requests, max_context_len, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self._in_use = [False] * max_running_requests

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index, or None when every row is in use."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.size or not self._in_use[row]:
            raise ValueError(f"row {row} is not allocated")
        self._in_use[row] = False
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set the slots of tokens `start .. start+len(slots)-1` of request `row`."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(f"context of {end} tokens exceeds max_context_len={self.max_context_len}")
        self.table[row, start:end] = slots.to(torch.int32)

    def write_at(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """Set `table[rows[i], cols[i]] = slots[i]` for every i (1-D, equal lengths)."""
        if cols.numel() and int(cols.max()) >= self.max_context_len:
            raise ValueError(
                f"context of {int(cols.max()) + 1} tokens exceeds max_context_len={self.max_context_len}"
            )
        self.table[rows, cols] = slots.to(torch.int32)

    def read_many(self, rows: list[int], ends: list[int]) -> torch.Tensor:
        """The slots of tokens `0 .. ends[i]-1` of request `rows[i]`, for every i,
        concatenated (one gather, whatever the number of rows)."""
        if any(end > self.max_context_len for end in ends):
            raise ValueError(f"context of {max(ends)} tokens exceeds max_context_len={self.max_context_len}")
        used = [(row, end) for row, end in zip(rows, ends, strict=True) if end > 0]
        if not used:
            return self.table.new_empty(0)
        lens = torch.tensor([end for _, end in used], dtype=torch.int64)  # [B']
        first = torch.tensor([row for row, _ in used], dtype=torch.int64) * self.max_context_len  # [B'] each row's start
        # The table positions step by one within a row and jump at each row's start: a
        # running sum of those steps (cheaper than repeat_interleave on the CPU).
        steps = torch.ones(int(lens.sum()), dtype=torch.int64)  # [N]
        steps[0] = first[0]
        steps[(lens.cumsum(0) - lens)[1:]] = first[1:] - (first[:-1] + lens[:-1] - 1)
        return self.table.view(-1).index_select(0, steps.cumsum(0))

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """The slots of tokens `start .. end-1` of request `row` (a view)."""
        return self.table[row, start:end]
