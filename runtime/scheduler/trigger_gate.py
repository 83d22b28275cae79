"""A constraint that starts at a trigger: the output is free until it writes the trigger
text (`SamplingParams.constraint_trigger`, e.g. `<tool_call>`), and the text after the
trigger must match the request's grammar. That is how a chat answer in `tool_choice`
"auto" may be plain content, yet a tool call, once begun, is a well-formed call of one of
the request's tools (llama.cpp's lazy grammars do the same).

Phases of one request's output:
- `FREE`: any token, stop tokens included (an answer without a call may end anywhere);
  the text is watched for the trigger;
- `CONSTRAINED`: the grammar itself, from the text after the trigger on;
- `STOPPED`: a stop token ended the output while it was free.

The trigger is found in the decoded text of the last few tokens, so it may span tokens;
text after it in the same token is fed to the grammar. Special tokens write no text there
(as the answer's text is decoded): one whose name is the trigger is the trigger, any other
is free output. A token whose text completes the
trigger and runs on with text the grammar refuses is masked out while free, so every
token the mask allows is accepted. The phase depends only on the request's own tokens
(batch invariance).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from sprig.runtime.constrained import Grammar
from sprig.runtime.constrained.vocabulary import token_bytes
from sprig.runtime.scheduler.gate import Gate, set_bits


class Phase(Enum):
    FREE = "free"
    CONSTRAINED = "constrained"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Trigger:
    """A trigger text read against one tokenizer once. `completing[j]` for j >= 1: the
    tokens whose text starts with `text[j:]` and runs on past it (they complete the
    trigger after an output ending in `text[:j]`); `completing[0]`: the tokens that hold
    all of `text` with more after it. Only these can complete the trigger and leave text
    for the grammar in the same token."""

    text: str
    completing: tuple[tuple[int, ...], ...]
    special: frozenset[int]  # the tokens that write no text
    named: frozenset[int]  # of them, those whose name is the trigger

    @classmethod
    def build(cls, tokenizer: Any, text: str) -> Trigger:
        whole, last = text.encode(), text.encode()[-1:]
        suffixes = [text[j:].encode() for j in range(len(text))]
        found: list[list[int]] = [[] for _ in text]
        written = token_bytes(tokenizer)
        special = [i for i, data in enumerate(written) if data is None]
        named = [i for i, name in zip(special, tokenizer.convert_ids_to_tokens(special), strict=True) if name == text]
        for token_id, data in enumerate(written):
            if data is None or last not in data[:-1]:  # every such token holds the last byte, then more
                continue
            at = data.find(whole)
            if at >= 0 and at + len(whole) < len(data):
                found[0].append(token_id)
            for j in range(1, len(text)):
                if len(data) > len(suffixes[j]) and data.startswith(suffixes[j]):
                    found[j].append(token_id)
        return cls(text, tuple(tuple(ids) for ids in found), frozenset(special), frozenset(named))

    @property
    def window(self) -> int:
        """Tokens decoded to look for the trigger: every token holds at least one of its
        characters, plus one for a character split across tokens."""
        return len(self.text) + 1


class TriggerGate(Gate):
    """Wraps a request's grammar matcher (see the module docstring); every `Grammar`
    invariant holds for the wrapped grammar once the trigger is written, and `rollback`
    undoes tokens of any phase."""

    grammar_phase = Phase.CONSTRAINED

    def __init__(self, inner: Grammar, trigger: Trigger, *, stop_token_ids: Iterable[int], tokenizer: Any) -> None:
        super().__init__(inner, Phase.FREE, tokenizer)
        self.trigger = trigger
        self._stops = frozenset(stop_token_ids)
        self._grammar_takes: dict[str, bool] = {}  # text after a trigger -> the fresh grammar takes it

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        if self.phase is Phase.CONSTRAINED:
            self.inner.fill_bitmask(bitmask_row)
            return
        bitmask_row.fill_(-1 if self.phase is Phase.FREE else 0)
        if self.phase is Phase.FREE:
            set_bits(bitmask_row, self._refused_completions(), allowed=False)

    def _refused_completions(self) -> list[int]:
        """The tokens that would now complete the trigger with text the grammar refuses."""
        out, text = [], None  # the tail decoded only when some token may complete a trigger it began
        for j, ids in enumerate(self.trigger.completing):
            if not ids:
                continue
            if j:
                text = self._decode(self._tail) if text is None else text
                if not text.endswith(self.trigger.text[:j]):
                    continue
            out.extend(t for t in ids if not self._takes(self._after_trigger(t)))
        return out

    def _after_trigger(self, token_id: int) -> str | None:
        """The text after the trigger if `token_id`, taken now, completes it; else None."""
        if token_id in self.trigger.special:
            return "" if token_id in self.trigger.named else None
        tail = (*self._tail, token_id)[-self.trigger.window :]
        text = self._decode(tail)
        at = text.find(self.trigger.text)
        return None if at < 0 else text[at + len(self.trigger.text) :]

    def _decode(self, ids: tuple[int, ...]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    def _ids(self, rest: str) -> list[int]:
        return self._tokenizer.encode(rest, add_special_tokens=False) if rest else []

    def _takes(self, rest: str | None) -> bool:
        """Whether the grammar, fresh, takes `rest` (None: no trigger, nothing to take)."""
        if rest is None or not rest:
            return True
        if rest not in self._grammar_takes:
            ids = self._ids(rest)
            ok = self.inner.accept_tokens(ids)
            if ok:
                self.inner.rollback(len(ids))
            self._grammar_takes[rest] = ok
        return self._grammar_takes[rest]

    def accept_token(self, token_id: int) -> bool:
        if self.phase is Phase.CONSTRAINED:
            return self.accept_tokens((token_id,))
        if self.phase is Phase.STOPPED:
            return False
        before = (self.phase, self._tail)
        took = 0
        if token_id in self._stops:
            self.phase = Phase.STOPPED
        else:
            rest = self._after_trigger(token_id)
            if rest is None:
                self._tail = (*self._tail, token_id)[-self.trigger.window :]
            else:
                ids = self._ids(rest)
                if ids and not self.inner.accept_tokens(ids):
                    return False
                self.phase, self._tail, took = Phase.CONSTRAINED, (), len(ids)
        self._record(token_id, before, took)
        return True

    def is_terminated(self) -> bool:
        return self.phase is not Phase.CONSTRAINED or self.inner.is_terminated()

    def is_finished(self) -> bool:
        return self.phase is Phase.STOPPED or (self.phase is Phase.CONSTRAINED and self.inner.is_finished())

    def forced_continuation(self) -> str | None:
        return self.inner.forced_continuation() if self.phase is Phase.CONSTRAINED else None
