"""Drafters: cheap guesses of a request's next tokens, verified by the target model.

A drafter is deterministic (its draft distribution q is one-hot at each proposed token),
pure with respect to the KV pool (it reads the radix tree but never locks, splits or
evicts), and may propose fewer than `k` tokens, or none. `DRAFTERS` maps each
`--speculative-algorithm` to a factory taking the scheduler's prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from sprig.radix import PrefixCache
from sprig.runtime.speculative.ngram import NgramDrafter
from sprig.runtime.speculative.radix_drafter import RadixDrafter


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens guessed to follow `context` (the request's prompt + output)."""
        ...


DRAFTERS: dict[str, Callable[[PrefixCache], Drafter]] = {
    "ngram": lambda cache: NgramDrafter(),
    "radix": RadixDrafter,
}
