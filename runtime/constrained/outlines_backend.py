"""The outlines-core grammar backend: every spec kind becomes a regex, then two `Index`es
of the marked regex (see `vocabulary.marked`: "may end here" = "the mark is allowed").

The token-level index (over the tokenizer's vocabulary) drives the bitmask and token
acceptance; the byte-level index (over `byte_vocabulary()`, one token per byte) is the
regex's byte automaton, walked alongside to find forced continuations for jump-forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from outlines_core import Guide, Index, Vocabulary

from sprig.runtime.constrained.base import (
    Grammar,
    GrammarSpec,
    bitmask_width,
    check_bitmask_row,
    forced_text,
)
from sprig.runtime.constrained.spec_regex import regex_error, spec_regex
from sprig.runtime.constrained.vocabulary import (
    BYTE_MARK,
    TokenVocabulary,
    build_vocabulary,
    byte_vocabulary,
    marked,
)

if TYPE_CHECKING:
    import torch


def _index(regex: str, vocabulary: Vocabulary) -> Index:
    try:
        return Index(marked(regex), vocabulary)
    except ValueError as e:
        raise regex_error(regex, str(e)) from None


@dataclass(frozen=True)
class OutlinesCompiled:
    """A spec compiled for one vocabulary (`fingerprint`, whose END_MARK token is
    `mark_id`). Immutable but for `_dead_ends`, a cache of which states admit no token."""

    spec: GrammarSpec
    regex: str
    index: Index
    byte_index: Index
    fingerprint: str
    mark_id: int
    _dead_ends: dict[int, bool] = field(default_factory=dict, compare=False, repr=False)

    def is_final(self, state: int) -> bool:
        """The output may end at `state`: the mark leads to an end. (The mark being merely
        allowed is not enough: a string's content may hold the mark's character too.)"""
        after = self.index.get_next_state(state, self.mark_id)
        return after is not None and self.index.is_final_state(after)

    def is_dead_end(self, state: int) -> bool:
        """No output token leaves `state`."""
        dead = self._dead_ends.get(state)
        if dead is None:
            allowed = self.index.get_allowed_tokens(state) or []
            dead = self._dead_ends[state] = all(t == self.mark_id for t in allowed)
        return dead


class OutlinesGrammar(Grammar):
    """A request's matcher over an `OutlinesCompiled` (see `Grammar` for invariants).

    Holds a `Guide` (token automaton) and the matching byte-automaton state (None if
    lost, which only a regex spelling END_MARK can cause); each history entry is (token
    id, byte state before it, whether it was a stop token).
    """

    def __init__(
        self,
        compiled: OutlinesCompiled,
        vocabulary: TokenVocabulary,
        stop_token_ids: frozenset[int],
        max_rollback: int,
    ) -> None:
        self.max_rollback = max_rollback
        self._compiled = compiled
        self._tokens = vocabulary.token_bytes
        self._stops = stop_token_ids
        self._guide = Guide(compiled.index, max_rollback=max_rollback)
        self._byte_state: int | None = compiled.byte_index.get_initial_state()
        self._history: deque[tuple[int, int | None, bool]] = deque(maxlen=max_rollback)
        self._stopped = False
        self._mask_words = bitmask_width(len(vocabulary.outlines) + 1)  # what outlines writes
        # (word, bit, allowed in a final state) for the stop ids, EOS and the mark
        special = stop_token_ids | {vocabulary.eos_token_id, compiled.mark_id}
        self._stop_bits = [
            (t // 32, np.uint32(1 << (t % 32)), t in stop_token_ids) for t in sorted(special)
        ]

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        row = bitmask_row
        check_bitmask_row(row, len(self._tokens))
        if self._stopped:
            row.zero_()
            return
        if row.numel() >= self._mask_words:
            self._guide.write_mask_into(row.data_ptr(), row.numel(), 4)
        else:  # outlines wants room for the mark too; the row ends before it
            scratch = row.new_zeros(self._mask_words)
            self._guide.write_mask_into(scratch.data_ptr(), scratch.numel(), 4)
            row.copy_(scratch[: row.numel()])
        final = self._compiled.is_final(self._guide.get_state())
        words = row.numpy().view(np.uint32)  # shares the row's memory
        for word, bit, is_stop in self._stop_bits:
            if word < len(words):
                words[word] = words[word] | bit if final and is_stop else words[word] & ~bit

    def _bytes_of(self, token_id: int) -> bytes | None:
        return self._tokens[token_id] if 0 <= token_id < len(self._tokens) else None

    def accept_token(self, token_id: int) -> bool:
        if self._stopped:
            return False
        if token_id in self._stops:
            if not self._compiled.is_final(self._guide.get_state()):
                return False
            self._history.append((token_id, self._byte_state, True))
            self._stopped = True
            return True
        data = self._bytes_of(token_id)
        if data is None:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        self._history.append((token_id, self._byte_state, False))
        byte_index = self._compiled.byte_index
        for byte in data:
            if self._byte_state is not None:
                self._byte_state = byte_index.get_next_state(self._byte_state, byte)
        return True

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """All or none, checked on the index first (so any length is atomic)."""
        ids = list(token_ids)
        compiled, state, stopped = self._compiled, self._guide.get_state(), self._stopped
        for token_id in ids:
            if stopped:
                return False
            if token_id in self._stops:
                stopped = compiled.is_final(state)
                if not stopped:
                    return False
                continue
            nxt = (
                compiled.index.get_next_state(state, token_id) if self._bytes_of(token_id) else None
            )
            if nxt is None:
                return False
            state = nxt
        return all([self.accept_token(t) for t in ids])

    def rollback(self, k: int) -> list[int]:
        if not 0 <= k <= len(self._history):
            raise ValueError(f"cannot roll back {k} tokens; {len(self._history)} can be")
        removed = [self._history.pop() for _ in range(k)][::-1]
        advanced = sum(not is_stop for _, _, is_stop in removed)
        if advanced:
            self._guide.rollback_state(advanced)
        if removed:
            self._byte_state = removed[0][1]
            self._stopped = False
        return [token_id for token_id, _, _ in removed]

    def is_terminated(self) -> bool:
        return self._stopped or self._compiled.is_final(self._guide.get_state())

    def is_finished(self) -> bool:
        state = self._guide.get_state()
        return self._stopped or (
            self._compiled.is_final(state) and self._compiled.is_dead_end(state)
        )

    def forced_continuation(self) -> str | None:
        if self._stopped or self._byte_state is None:
            return None
        index, state, out = self._compiled.byte_index, self._byte_state, bytearray()
        while True:
            allowed = index.get_allowed_tokens(state) or []
            if len(allowed) != 1 or allowed[0] == BYTE_MARK:  # a choice, or the end
                break
            out.append(allowed[0])
            state = index.get_next_state(state, allowed[0])
        return forced_text(bytes(out))


@dataclass(frozen=True)
class OutlinesBackend:
    """`GrammarBackend` over outlines-core for one tokenizer's `vocabulary`."""

    vocabulary: TokenVocabulary

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, logits_width: int | None = None) -> OutlinesBackend:
        return cls(build_vocabulary(tokenizer, logits_width=logits_width))

    @property
    def fingerprint(self) -> str:
        return self.vocabulary.fingerprint

    def compile(self, spec: GrammarSpec) -> OutlinesCompiled:
        regex = spec_regex(spec)
        byte_index = _index(regex, byte_vocabulary())
        index = _index(regex, self.vocabulary.outlines)
        mark = self.vocabulary.mark_id
        return OutlinesCompiled(spec, regex, index, byte_index, self.fingerprint, mark)

    def prepare(self, compiled: OutlinesCompiled) -> OutlinesCompiled:
        """Nothing to build: the indices unpickle whole."""
        return compiled

    def matcher(
        self,
        compiled: OutlinesCompiled,
        *,
        stop_token_ids: Iterable[int] | None = None,
        max_rollback: int = 64,
    ) -> OutlinesGrammar:
        """A fresh matcher; `stop_token_ids` defaults to the tokenizer's EOS."""
        if compiled.fingerprint != self.fingerprint:
            raise ValueError("grammar was compiled for a different tokenizer")
        eos = self.vocabulary.eos_token_id
        stops = frozenset(stop_token_ids if stop_token_ids is not None else {eos})
        return OutlinesGrammar(compiled, self.vocabulary, stops, max_rollback)
