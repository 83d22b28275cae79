"""Token trees: alternative paths verified beside a request's draft in the same target pass.

Each alternative is a sequence of its own in the verification pass: the request's pending
token and the whole path, at slots taken from the free list, over the request's context.
So the causal mask is the only mask needed, at the price of computing the prefix it
shares with the draft again (the same K/V: the same tokens at the same positions over the
same context). After the pass the coupling (`accept.tree_walk`) picks the path its tokens
lie on; if that is an alternative, the request adopts its slots (`RequestKV.adopt`), and
every other alternative's slots are freed in the same step. Page size 1 only: an adopted
run of slots must be able to start at any position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Branch:
    """An alternative path of request `batch[owner]`, verified beside its draft."""

    owner: int
    tokens: list[int]  # the whole path, from where the draft starts
    depth: int  # its first tokens the draft shares (< len(tokens))
    slots: torch.Tensor  # [1 + len(tokens)] int64: the pending token's slot, then the path's
    masks: list[torch.Tensor] | None = None  # a constrained owner's grammar bitmask of each of its rows


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
