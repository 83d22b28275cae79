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
"""

from __future__ import annotations

import torch

from sprig.runtime.constrained import Grammar


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
