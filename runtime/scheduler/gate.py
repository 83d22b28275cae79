"""The shared mechanics of a grammar deferred behind free output (`ReasoningGate`,
`TriggerGate`): the wrapped grammar, the phase, the last free tokens watched for a marker,
and a history that lets `rollback` cross phases."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from enum import Enum
from typing import Any

import numpy as np
import torch

from sprig.runtime.constrained import Grammar


def set_bits(bitmask_row: torch.Tensor, token_ids: Iterable[int], allowed: bool) -> None:
    """Allow (or forbid) `token_ids` in a bitmask row; ids past its width are ignored."""
    words = bitmask_row.numpy().view(np.uint32)
    for t in token_ids:
        if t // 32 < len(words):
            bit = np.uint32(1 << (t % 32))
            words[t // 32] = words[t // 32] | bit if allowed else words[t // 32] & ~bit


class Gate(Grammar):
    """A request's grammar behind a phase of free output. Subclasses decide the phases;
    in `grammar_phase` every token goes to the wrapped grammar. Invariant: each accepted
    token has a history entry (its id, the phase and tail before it, how many tokens the
    wrapped grammar took for it), so `rollback(k)` restores any earlier state exactly."""

    grammar_phase: Enum

    def __init__(self, inner: Grammar, phase: Enum, tokenizer: Any) -> None:
        self.inner = inner
        self.max_rollback = inner.max_rollback
        self.phase = phase
        self._tokenizer = tokenizer
        self._tail: tuple[int, ...] = ()  # the last free tokens, for the marker search
        self._history: deque[tuple[int, Enum, tuple[int, ...], int]] = deque(maxlen=inner.max_rollback)

    def _record(self, token_id: int, before: tuple[Enum, tuple[int, ...]], took: int) -> None:
        self._history.append((token_id, *before, took))

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        if self.phase is not self.grammar_phase:
            return super().accept_tokens(token_ids)
        ids = list(token_ids)
        if not self.inner.accept_tokens(ids):
            return False
        self._history.extend((t, self.grammar_phase, (), 1) for t in ids)
        return True

    def rollback(self, k: int) -> list[int]:
        if not 0 <= k <= len(self._history):
            raise ValueError(f"cannot roll back {k} tokens; {len(self._history)} can be")
        if k == 0:
            return []
        removed = [self._history.pop() for _ in range(k)][::-1]
        self.inner.rollback(sum(took for *_, took in removed))
        _, self.phase, self._tail, _ = removed[0]
        return [token_id for token_id, *_ in removed]
