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
- `ANSWER`: the grammar itself;
- `EXITED`: an exit ended the output while thinking; the gate is finished and takes no
  further token.

The phase depends only on the request's own tokens, so the output does not depend on
what else is batched (batch invariance). The end marker is found in the decoded text of
the last few tokens (special tokens written as their names), so it may span tokens; text
after it in the same token is fed to the grammar (leading blanks dropped). A token that
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


class Phase(Enum):
    START = "start"
    THINKING = "thinking"
    ANSWER = "answer"
    EXITED = "exited"


@dataclass(frozen=True)
class Markers:
    """The markers of one request, read against the tokenizer once per set of markers.
    `end`: the end marker, decoded with special tokens as their names; `start_ids`:
    tokens whose text is exactly the start marker (empty when none is, or when the
    output opens inside the reasoning); `exit_ids`: tokens whose text is exactly one of
    the exit texts (a text no single token spells has none)."""

    end: Marker
    start_ids: frozenset[int]
    exit_ids: frozenset[int] = frozenset()

    @classmethod
    def build(cls, tokenizer: Any, start: str | None, end: str, exits: Iterable[str] = ()) -> Markers:
        return cls(Marker.build(tokenizer, end, names_written=True),
                   _tokens_spelling(tokenizer, () if start is None else (start,)),
                   _tokens_spelling(tokenizer, exits))


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
    allows exactly the tokens `accept_token` takes."""

    grammar_phase = Phase.ANSWER

    drops_leading_blanks = True

    def __init__(self, inner: Grammar, markers: Markers, *, opens_inside: bool,
                 stop_token_ids: Iterable[int], tokenizer: Any) -> None:
        super().__init__(inner, Phase.THINKING if opens_inside else Phase.START, markers.end, tokenizer)
        self.markers = markers
        stops = frozenset(stop_token_ids)
        self._exits = markers.exit_ids & stops
        self._stops = sorted(stops - self._exits)  # forbidden while thinking

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        if self.phase is Phase.EXITED:
            bitmask_row.fill_(0)
            return
        if self.phase is Phase.THINKING:
            bitmask_row.fill_(-1)
            set_bits(bitmask_row, self._stops, allowed=False)
            set_bits(bitmask_row, self.refused_completions(), allowed=False)
            return
        self.inner.fill_bitmask(bitmask_row)
        if self.phase is Phase.START:
            set_bits(bitmask_row, self.markers.start_ids, allowed=True)

    def accept_token(self, token_id: int) -> bool:
        if self.phase is Phase.EXITED:
            return False
        before = (self.phase, self._tail)
        took = 0
        if self.phase is Phase.ANSWER or (self.phase is Phase.START and token_id not in self.markers.start_ids):
            if not self.inner.accept_token(token_id):
                return False
            self.phase, took = Phase.ANSWER, 1
        elif self.phase is Phase.START:
            self.phase = Phase.THINKING
        elif token_id in self._exits:
            self.phase = Phase.EXITED
        elif token_id in self._stops:
            return False
        else:
            took = self._take_free(token_id)
            if took is None:
                took = 0
            elif took < 0:
                return False
            else:
                self.phase = Phase.ANSWER
        self._record(token_id, before, took)
        return True

    def is_terminated(self) -> bool:
        return self.phase is Phase.EXITED or (self.phase is Phase.ANSWER and self.inner.is_terminated())

    def is_finished(self) -> bool:
        return self.phase is Phase.EXITED or (self.phase is Phase.ANSWER and self.inner.is_finished())

    def forced_continuation(self) -> str | None:
        return self.inner.forced_continuation() if self.phase is Phase.ANSWER else None
