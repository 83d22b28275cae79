"""The shared mechanics of a grammar deferred behind free output (`ReasoningGate`,
`TriggerGate`): the wrapped grammar, the phase, the last free tokens watched for the
marker that starts the grammar, the free tokens the mask must refuse, and a history that
lets `rollback` cross phases."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from enum import Enum
from typing import Any

import numpy as np
import torch

from sprig.runtime.constrained import Grammar
from sprig.runtime.scheduler.marker import Marker


def set_bits(bitmask_row: torch.Tensor, token_ids: Iterable[int], allowed: bool) -> None:
    """Allow (or forbid) `token_ids` in a bitmask row; ids past its width are ignored."""
    words = bitmask_row.numpy().view(np.uint32)
    for t in token_ids:
        if t // 32 < len(words):
            bit = np.uint32(1 << (t % 32))
            words[t // 32] = words[t // 32] | bit if allowed else words[t // 32] & ~bit


class Gate(Grammar):
    """A request's grammar behind a phase of free output, which ends where the output
    writes `marker`. Subclasses decide the phases; in `grammar_phase` every token goes to
    the wrapped grammar. Text after the marker in the token that completes it is fed to
    the grammar (leading blanks dropped where `drops_leading_blanks`); a free token whose
    text the grammar would refuse so is one the mask must refuse (`refused_completions`),
    so that every token the mask allows is accepted. Invariant: each accepted token has a
    history entry (its id, the gate's state before it, how many tokens the wrapped
    grammar took for it), so `rollback(k)` restores any earlier state exactly. A
    subclass with more state than the phase and the tail extends `_state` and
    `_restore`."""

    grammar_phase: Enum
    drops_leading_blanks = False

    def __init__(self, inner: Grammar, phase: Enum, marker: Marker, tokenizer: Any) -> None:
        self.inner = inner
        self.max_rollback = inner.max_rollback
        self.phase = phase
        self.marker = marker
        self._tokenizer = tokenizer
        self._tail: tuple[int, ...] = ()  # the last free tokens, for the marker search
        self._history: deque[tuple[int, tuple[Any, ...], int]] = deque(maxlen=inner.max_rollback)
        self._grammar_takes: dict[str, bool] = {}  # text after the marker -> the fresh grammar takes it

    def _take_free(self, token_id: int) -> int | None:
        """Take one free token: None if it does not complete the marker (it joins the
        tail), -1 if it does and the grammar refuses the text after it (nothing changes),
        else how many tokens the grammar took from that text (the tail is emptied; the
        caller moves to `grammar_phase`)."""
        rest = self._after_marker(token_id)
        if rest is None:
            self._tail = (*self._tail, token_id)[-self.marker.window :]
            return None
        ids = self._ids(rest)
        if ids and not self.inner.accept_tokens(ids):
            return -1
        self._tail = ()
        return len(ids)

    def refused_completions(self) -> list[int]:
        """The free tokens that would now complete the marker with text the grammar
        refuses."""
        out, text = [], None  # the tail decoded only when some token may complete a marker it began
        for j, ids in enumerate(self.marker.completing):
            if not ids:
                continue
            if j:
                text = self.marker.decode(self._tokenizer, self._tail) if text is None else text
                if not text.endswith(self.marker.text[:j]):
                    continue
            out.extend(t for t in ids if not self._takes(self._after_marker(t)))
        return out

    def _after_marker(self, token_id: int) -> str | None:
        """The text the grammar is given if `token_id`, taken now, completes the marker;
        else None."""
        if token_id in self.marker.special:
            return "" if token_id in self.marker.named else None
        text = self.marker.decode(self._tokenizer, (*self._tail, token_id)[-self.marker.window :])
        at = text.find(self.marker.text)
        if at < 0:
            return None
        rest = text[at + len(self.marker.text) :]
        return rest.lstrip() if self.drops_leading_blanks else rest

    def _ids(self, rest: str) -> list[int]:
        return self._tokenizer.encode(rest, add_special_tokens=False) if rest else []

    def _takes(self, rest: str | None) -> bool:
        """Whether the grammar, fresh, takes `rest` (None: no marker, nothing to take)."""
        if not rest:
            return True
        if rest not in self._grammar_takes:
            ids = self._ids(rest)
            ok = self.inner.accept_tokens(ids)
            if ok:
                self.inner.rollback(len(ids))
            self._grammar_takes[rest] = ok
        return self._grammar_takes[rest]

    def _state(self) -> tuple[Any, ...]:
        """What `rollback` restores: the phase and the tail."""
        return self.phase, self._tail

    def _restore(self, state: tuple[Any, ...]) -> None:
        self.phase, self._tail = state

    def _record(self, token_id: int, before: tuple[Any, ...], took: int) -> None:
        self._history.append((token_id, before, took))

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        if self.phase is not self.grammar_phase:
            return super().accept_tokens(token_ids)
        ids = list(token_ids)
        if not self.inner.accept_tokens(ids):
            return False
        state = self._state()
        self._history.extend((t, state, 1) for t in ids)
        return True

    def rollback(self, k: int) -> list[int]:
        if not 0 <= k <= len(self._history):
            raise ValueError(f"cannot roll back {k} tokens; {len(self._history)} can be")
        if k == 0:
            return []
        removed = [self._history.pop() for _ in range(k)][::-1]
        self.inner.rollback(sum(took for *_, took in removed))
        self._restore(removed[0][1])
        return [token_id for token_id, *_ in removed]
