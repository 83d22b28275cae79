"""A constraint deferred past a reasoning model's thinking: the request's grammar applies
only to the text after the end-of-reasoning marker (`</think>`; for gpt-oss's harmony,
`<|channel|>final<|message|>`, special tokens being decoded here as their names), so
`response_format` and forced tool calls work with models that think first.

Phases of one request's output:
- `START` (the params give `reasoning_start`): the output may open the reasoning with a
  token that spells the start marker exactly, or answer at once; the mask is the grammar's
  plus those tokens;
- `THINKING`: any token but a stop token (the answer is still owed), save the exits
  (`reasoning_exits`: stop tokens that may end the output in place of the answer, as
  harmony's `<|call|>` ends a tool call written before any final channel); the reasoning
  text is watched for the end marker;
- `CLOSING` (the params give `thinking_budget`): the reasoning has taken its budget of
  tokens, and the mask allows only the next token of the end marker's own tokenization
  (`Markers.end_ids`) until the marker is written. The budget is first held open for up to
  `CHARACTER_WAIT` tokens while the reasoning ends inside a character, so it never closes
  on half a character;
- `ANSWER`: the grammar itself;
- `EXITED`: an exit ended the output while thinking; the gate is finished and takes no
  further token.

The phase depends only on the request's own tokens, so the output does not depend on
what else is batched (batch invariance). Until its budget is spent a request's tokens are
those it writes without one: the budget changes no mask before it closes the reasoning.
The end marker is found in the decoded text of the last few tokens (special tokens
written as their names), so it may span tokens; text after it in the same token is fed
to the grammar (leading blanks dropped). A token that
would complete the marker with text the grammar refuses is masked out while thinking, so
every token the mask allows is accepted: a plain-text marker (`Answer:` before a number)
cannot end in a token (`: `... `:"`) that leaves the request nowhere to go.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from sprig.runtime.constrained import Grammar
from sprig.runtime.scheduler.gate import Gate, set_bits
from sprig.runtime.scheduler.marker import Marker

CHARACTER_WAIT = 3  # tokens a spent budget waits for a character to end: UTF-8 has at most 4 bytes


class Phase(Enum):
    START = "start"
    THINKING = "thinking"
    CLOSING = "closing"
    ANSWER = "answer"
    EXITED = "exited"


@dataclass(frozen=True)
class Markers:
    """The markers of one request, read against the tokenizer once per set of markers.
    `end`: the end marker, decoded with special tokens as their names; `start_ids`:
    tokens whose text is exactly the start marker (empty when none is, or when the
    output opens inside the reasoning); `exit_ids`: tokens whose text is exactly one of
    the exit texts (a text no single token spells has none); `end_ids`: the end marker's
    own tokenization (special tokens by name), what a spent thinking budget writes."""

    end: Marker
    start_ids: frozenset[int]
    exit_ids: frozenset[int] = frozenset()
    end_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, tokenizer: Any, start: str | None, end: str, exits: Iterable[str] = ()) -> Markers:
        return cls(Marker.build(tokenizer, end, names_written=True),
                   _tokens_spelling(tokenizer, () if start is None else (start,)),
                   _tokens_spelling(tokenizer, exits),
                   tuple(tokenizer.encode(end, add_special_tokens=False)))


def _tokens_spelling(tokenizer: Any, texts: Iterable[str]) -> frozenset[int]:
    """The tokens whose decoded text is exactly one of `texts`."""
    ids: set[int] = set()
    for text in texts:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and tokenizer.decode([token_id]) == text:
            ids.add(token_id)
    return frozenset(ids)


class ReasoningGate(Gate):
    """Wraps a request's grammar matcher (see the module docstring); every `Grammar`
    invariant holds for the wrapped grammar once the answer begins, and `rollback` undoes
    tokens of any phase. The exits are the markers' exit tokens among `stop_token_ids`
    (one that is no stop token is an ordinary reasoning token); while thinking the mask
    allows exactly the tokens `accept_token` takes. `budget`: the most tokens the
    reasoning may take before the gate closes it (None: no limit); the start marker and
    the end marker's tokens are not counted."""

    grammar_phase = Phase.ANSWER

    drops_leading_blanks = True

    def __init__(self, inner: Grammar, markers: Markers, *, opens_inside: bool,
                 stop_token_ids: Iterable[int], tokenizer: Any, budget: int | None = None) -> None:
        super().__init__(inner, Phase.THINKING if opens_inside else Phase.START, markers.end, tokenizer)
        self.markers = markers
        self.budget = budget
        stops = frozenset(stop_token_ids)
        self._exits = markers.exit_ids & stops
        self._stops = sorted(stops - self._exits)  # forbidden while thinking
        self._spent = 0  # tokens the reasoning took
        self._written = 0  # tokens of the end marker a spent budget wrote
        if self.phase is Phase.THINKING:
            self._close_if_spent()

    def _state(self) -> tuple[Any, ...]:
        return *super()._state(), self._spent, self._written

    def _restore(self, state: tuple[Any, ...]) -> None:
        *base, self._spent, self._written = state
        super()._restore(tuple(base))

    def _close_if_spent(self) -> None:
        """Move to `CLOSING` once the budget is spent and the reasoning does not end
        inside a character (or has waited `CHARACTER_WAIT` tokens for it to end)."""
        if self.budget is None or self._spent < self.budget:
            return
        if self._spent < self.budget + CHARACTER_WAIT and self._mid_character():
            return
        self.phase = Phase.CLOSING

    def _mid_character(self) -> bool:
        """Whether the reasoning's text ends in part of a character: its last tokens (at
        most four, the bytes of the longest character) decode to a replacement mark."""
        recent = [token_id for token_id, (phase, *_), _ in list(self._history)[-4:] if phase is Phase.THINKING]
        return bool(recent) and self._tokenizer.decode(recent).endswith("\ufffd")

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        if self.phase is Phase.EXITED:
            bitmask_row.fill_(0)
            return
        if self.phase is Phase.CLOSING:
            bitmask_row.fill_(0)
            set_bits(bitmask_row, self.markers.end_ids[self._written : self._written + 1], allowed=True)
            return
        if self.phase is Phase.THINKING:
            bitmask_row.fill_(-1)
            set_bits(bitmask_row, self._stops, allowed=False)
            set_bits(bitmask_row, self.refused_completions(), allowed=False)
            return
        self.inner.fill_bitmask(bitmask_row)
        if self.phase is Phase.START:
            set_bits(bitmask_row, self.markers.start_ids, allowed=True)

    def allows_all(self) -> bool:
        """While thinking with no stop token held back, or answering, over a grammar that
        allows every token (a budget without a constraint: `FreeGrammar`, which refuses no
        text after the marker either)."""
        if self.phase is Phase.THINKING:
            return not self._stops and self.inner.allows_all()
        return self.phase is Phase.ANSWER and self.inner.allows_all()

    def accept_token(self, token_id: int) -> bool:
        if self.phase is Phase.EXITED:
            return False
        before = self._state()
        took = 0
        if self.phase is Phase.ANSWER or (self.phase is Phase.START and token_id not in self.markers.start_ids):
            if not self.inner.accept_token(token_id):
                return False
            self.phase, took = Phase.ANSWER, 1
        elif self.phase is Phase.START:
            self.phase = Phase.THINKING
        elif self.phase is Phase.CLOSING:
            if token_id != self.markers.end_ids[self._written]:
                return False
            took = self._take_end(token_id)
            if took < 0:
                return False
        elif token_id in self._exits:
            self.phase = Phase.EXITED
        elif token_id in self._stops:
            return False
        else:
            took = self._take_free(token_id)
            if took is None:
                took = 0
                self._spent += 1
            elif took < 0:
                return False
            else:
                self.phase = Phase.ANSWER
        self._record(token_id, before, took)
        if self.phase is Phase.THINKING:
            self._close_if_spent()
        return True

    def _take_end(self, token_id: int) -> int:
        """Take the next token of the end marker a spent budget writes: how many tokens the
        grammar took from text after the marker (the answer begins once the marker is
        written, or once all its tokens are), or -1 if the grammar refuses that text."""
        took = self._take_free(token_id)
        if took is not None and took < 0:
            return -1
        self._written += 1
        if took is None and self._written < len(self.markers.end_ids):
            return 0
        self.phase, self._tail = Phase.ANSWER, ()
        return took or 0

    def is_terminated(self) -> bool:
        return self.phase is Phase.EXITED or (self.phase is Phase.ANSWER and self.inner.is_terminated())

    def is_finished(self) -> bool:
        return self.phase is Phase.EXITED or (self.phase is Phase.ANSWER and self.inner.is_finished())

    def forced_continuation(self) -> str | None:
        return self.inner.forced_continuation() if self.phase is Phase.ANSWER else None
