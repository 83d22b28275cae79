"""A constraint deferred past a reasoning model's thinking: the request's grammar applies
only to the text after the end-of-reasoning marker (`</think>`), so `response_format` and
forced tool calls work with models that think first.

Phases of one request's output:
- `START` (the params give `reasoning_start`): the output may open the reasoning with a
  token that spells the start marker exactly, or answer at once; the mask is the grammar's
  plus those tokens;
- `THINKING`: any token but a stop token (the answer is still owed); the reasoning text
  is watched for the end marker;
- `ANSWER`: the grammar itself.

The phase depends only on the request's own tokens, so the output does not depend on
what else is batched (batch invariance). The end marker is found in the decoded text of
the last few tokens, so it may span tokens; text after it in the same token is fed to the
grammar (blanks dropped), and if the grammar refuses it, so is the token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from sprig.runtime.constrained import Grammar


class Phase(Enum):
    START = "start"
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True)
class Markers:
    """The markers of one request, read against the tokenizer once per marker pair.
    `start_ids`: tokens whose text is exactly the start marker (empty when none is, or
    when the output opens inside the reasoning)."""

    end: str
    start_ids: frozenset[int]

    @classmethod
    def build(cls, tokenizer: Any, start: str | None, end: str) -> Markers:
        ids: set[int] = set()
        if start is not None:
            token_id = tokenizer.convert_tokens_to_ids(start)
            if isinstance(token_id, int) and tokenizer.decode([token_id]) == start:
                ids.add(token_id)
        return cls(end, frozenset(ids))

    @property
    def window(self) -> int:
        """Tokens decoded to look for the end marker: every token holds at least one of
        its characters, plus one for a character split across tokens."""
        return len(self.end) + 1


class ReasoningGate(Grammar):
    """Wraps a request's grammar matcher (see the module docstring); every `Grammar`
    invariant holds for the wrapped grammar once the answer begins, and `rollback` undoes
    tokens of any phase."""

    def __init__(self, inner: Grammar, markers: Markers, *, opens_inside: bool,
                 stop_token_ids: Iterable[int], tokenizer: Any) -> None:
        self.inner = inner
        self.max_rollback = inner.max_rollback
        self.markers = markers
        self.phase = Phase.THINKING if opens_inside else Phase.START
        self._stops = sorted(set(stop_token_ids))
        self._tokenizer = tokenizer
        self._tail: tuple[int, ...] = ()  # the last reasoning tokens, for the marker search
        # per accepted token: (its id, phase before, tail before, tokens the inner grammar took)
        self._history: deque[tuple[int, Phase, tuple[int, ...], int]] = deque(maxlen=inner.max_rollback)

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        if self.phase is Phase.THINKING:
            bitmask_row.fill_(-1)
            words = bitmask_row.numpy().view(np.uint32)
            for t in self._stops:
                if t // 32 < len(words):
                    words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            return
        self.inner.fill_bitmask(bitmask_row)
        if self.phase is Phase.START:
            words = bitmask_row.numpy().view(np.uint32)
            for t in self.markers.start_ids:
                if t // 32 < len(words):
                    words[t // 32] |= np.uint32(1 << (t % 32))

    def accept_token(self, token_id: int) -> bool:
        before = (self.phase, self._tail)
        took = 0
        if self.phase is Phase.ANSWER or (self.phase is Phase.START and token_id not in self.markers.start_ids):
            if not self.inner.accept_token(token_id):
                return False
            self.phase, took = Phase.ANSWER, 1
        elif self.phase is Phase.START:
            self.phase = Phase.THINKING
        elif token_id in self._stops:
            return False
        else:
            took = self._think(token_id)
            if took < 0:
                return False
        self._history.append((token_id, *before, took))
        return True

    def _think(self, token_id: int) -> int:
        """Take one reasoning token: how many tokens the grammar took from the text after
        the end marker if this token completes it (0 if it does not, -1 if the grammar
        refuses that text)."""
        tail = (*self._tail, token_id)[-self.markers.window :]
        text = self._tokenizer.decode(list(tail))
        at = text.find(self.markers.end)
        if at < 0:
            self._tail = tail
            return 0
        rest = text[at + len(self.markers.end) :].lstrip()
        ids = self._tokenizer.encode(rest, add_special_tokens=False) if rest else []
        if ids and not self.inner.accept_tokens(ids):
            return -1
        self.phase, self._tail = Phase.ANSWER, ()
        return len(ids)

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        if self.phase is not Phase.ANSWER:
            return super().accept_tokens(token_ids)
        ids = list(token_ids)
        if not self.inner.accept_tokens(ids):
            return False
        self._history.extend((t, Phase.ANSWER, (), 1) for t in ids)
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

    def is_terminated(self) -> bool:
        return self.phase is Phase.ANSWER and self.inner.is_terminated()

    def is_finished(self) -> bool:
        return self.phase is Phase.ANSWER and self.inner.is_finished()

    def forced_continuation(self) -> str | None:
        return self.inner.forced_continuation() if self.phase is Phase.ANSWER else None
