"""Drafts of constrained requests, fitted to their grammars before verification.

A constrained request's verification row j is sampled under the mask its grammar gives
after the first j drafts, as the plain decode step masks that token after emitting them
(`grammar_rows`). Each draft is cut before the first token the grammar refuses (the target
could never sample it), before a token that finishes the grammar (no row after it is
emitted, and its mask would allow nothing), and, where jump-forward runs, before a token
after which the grammar forces text: a jump appends that text when such a token is
emitted, so the token must be the last one a verification emits, as the plain step would
emit it last before jumping. The grammar is left where it was: tokens enter it only as
they are emitted (`Stops.after_token`).

The draft model proposes under the grammars too (`GrammarWalk`): a draft it would
propose outside a request's grammar is cut at its first token, so it drafts the best
token the grammar allows instead.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from sprig.kernels.logit_mask import apply_token_bitmask
from sprig.runtime.constrained import Grammar, bitmask_width


def grammar_rows(grammar: Grammar, draft: list[int], width: int,
                 jumps: bool) -> tuple[list[int], list[torch.Tensor], bool]:
    """(the part of `draft` kept, the bitmask of each of its `len(kept) + 1` rows: row j
    the grammar's after the first j kept tokens, and whether the grammar refused the next
    draft: a rejection, which the target could never have kept). `width`: a bitmask
    row's int32 words; `jumps`: whether jump-forward runs for the request. The grammar is
    unchanged after."""
    rows: list[torch.Tensor] = []
    kept: list[int] = []
    taken = 0
    try:
        for token in draft[: max(0, grammar.max_rollback - 1)]:
            rows.append(_row(grammar, width))
            if not _allows(rows[-1], token) or not grammar.accept_token(token):
                return kept, rows, True
            taken += 1
            if grammar.is_finished() or (jumps and grammar.forced_continuation()):
                return kept, rows, False
            kept.append(token)
        rows.append(_row(grammar, width))
        return kept, rows, False
    finally:
        grammar.rollback(taken)


def _row(grammar: Grammar, width: int) -> torch.Tensor:
    row = torch.zeros(width, dtype=torch.int32)
    grammar.fill_bitmask(row)
    return row


def _allows(row: torch.Tensor, token: int) -> bool:
    return token // 32 < row.numel() and bool(int(row[token // 32]) >> (token % 32) & 1)


class GrammarWalk:
    """The grammars of the requests a draft model drafts for, walked along its proposals:
    at each step a constrained request proposes its best token among those its grammar
    allows after the proposals before it (`mask` the step's logits, then `take` the
    token proposed). A grammar stops being walked at a proposal it refuses (a row that
    allowed nothing), at one that finishes it, and one short of its rollback limit; the
    request's later proposals are then the draft's plain argmax, which `grammar_rows`
    cuts before verification. `close` rolls every grammar back to where it was, as
    drafting must leave it (tokens enter a grammar only as they are emitted).

    Proposals stay a deterministic function of the request's own context and grammar
    state: the drafter is still one-hot, as `accept.tree_walk` needs. Shared state:
    a walk `over` other row numbers walks the same grammars."""

    def __init__(self, grammars: Sequence[Grammar | None]) -> None:
        self._grammars = list(grammars)
        self._taken = [0] * len(grammars)
        self._walking = [g is not None and g.max_rollback > 1 for g in grammars]
        self._rows: dict[int, torch.Tensor] = {}  # request -> the bitmask its last `mask` applied
        self._keys: Sequence[int] = range(len(grammars))

    def over(self, keys: Sequence[int]) -> GrammarWalk:
        """This walk for a batch whose row b is this walk's request `keys[b]`."""
        view = copy.copy(self)  # the same lists
        view._keys = [self._keys[k] for k in keys]
        return view

    @torch.inference_mode()  # the runner's logits are inference tensors
    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[int, int]]) -> None:
        """Limit `logits[i]` (float `[N, V]`, in place) to what request b's grammar allows,
        for each `(i, b)` in `rows` whose grammar is walked."""
        walked = [(i, self._keys[b]) for i, b in rows if self._walking[self._keys[b]]]
        if not walked:
            return
        bitmask = torch.zeros(len(walked), bitmask_width(logits.shape[-1]), dtype=torch.int32)
        for row, (_, k) in zip(bitmask, walked, strict=True):
            self._grammars[k].fill_bitmask(row)
            self._rows[k] = row
        apply_token_bitmask(logits, bitmask.to(logits.device),
                            rows=torch.tensor([i for i, _ in walked], device=logits.device))

    def take(self, b: int, token: int) -> None:
        """Request b proposed `token` from the logits `mask` limited last."""
        k = self._keys[b]
        if not self._walking[k]:
            return
        grammar = self._grammars[k]
        if not _allows(self._rows.pop(k), token) or not grammar.accept_token(token):
            self._walking[k] = False
            return
        self._taken[k] += 1
        if grammar.is_finished() or self._taken[k] >= grammar.max_rollback - 1:
            self._walking[k] = False

    def close(self) -> None:
        """Roll every grammar back over the proposals it took."""
        for k, grammar in enumerate(self._grammars):
            if self._taken[k]:
                grammar.rollback(self._taken[k])
                self._taken[k] = 0
