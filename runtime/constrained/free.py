"""The grammar of an unconstrained output: what a gate wraps when a request has a phase to
watch (a thinking budget) but no constraint."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sprig.runtime.constrained.base import Grammar

if TYPE_CHECKING:
    import torch


class FreeGrammar(Grammar):
    """Allows every token id, as an unconstrained request's sampler does (ids past the
    tokenizer's too), accepts every token and never finishes: whether a stop token ends
    the output is left to the stop checks, so `ignore_eos` and `min_new_tokens` keep
    their meaning. `rollback(k)` returns the last k tokens for k up to `max_rollback`."""

    def __init__(self, max_rollback: int = 64) -> None:
        self.max_rollback = max_rollback
        self._accepted: deque[int] = deque(maxlen=max_rollback)

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        bitmask_row.fill_(-1)

    def allows_all(self) -> bool:
        return True

    def accept_token(self, token_id: int) -> bool:
        self._accepted.append(token_id)
        return True

    def rollback(self, k: int) -> list[int]:
        if not 0 <= k <= len(self._accepted):
            raise ValueError(f"cannot roll back {k} tokens; {len(self._accepted)} can be")
        return [self._accepted.pop() for _ in range(k)][::-1]

    def is_terminated(self) -> bool:
        return True

    def is_finished(self) -> bool:
        return False

    def forced_continuation(self) -> str | None:
        return None
