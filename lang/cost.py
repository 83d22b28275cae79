"""What model calls cost, read from the `meta_info` the server returns with each one.

`Cost` values add up with `+`; a `Ledger` is the thread-safe running sum a program state
and all of its forks share, so `state.cost()` covers every call the program made.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cost:
    """Tokens, calls and time spent on model calls.

    `calls` counts HTTP requests (a batched request of many prompts is one call; its
    tokens are the sum over the prompts). `latency_s` sums each call's latency — the
    server's `e2e_latency` when it reports one, else the time the client waited — and
    `wall_s` is elapsed time: for a single call the two are equal, for calls that ran
    concurrently `latency_s` exceeds `wall_s`, which a strategy measures around itself
    (`with_wall`). Addition adds every field (sequential composition).
    """

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    wall_s: float = 0.0

    @classmethod
    def of_call(cls, metas: Mapping[str, Any] | Iterable[Mapping[str, Any]], waited_s: float) -> Cost:
        """The cost of one request from its response meta_info (or the list of them, one
        per prompt of a batched request)."""
        items = [metas] if isinstance(metas, Mapping) else list(metas)
        latency = max((float(m["e2e_latency"]) for m in items if "e2e_latency" in m), default=waited_s)
        return cls(
            calls=1,
            prompt_tokens=sum(int(m.get("prompt_tokens", 0)) for m in items),
            cached_tokens=sum(int(m.get("cached_tokens", 0)) for m in items),
            completion_tokens=sum(int(m.get("completion_tokens", 0)) for m in items),
            latency_s=latency,
            wall_s=latency,
        )

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def with_wall(self, wall_s: float) -> Cost:
        """This cost with `wall_s` replaced by a measured elapsed time."""
        return dataclasses.replace(self, wall_s=wall_s)

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache (0 when no prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def total(costs: Iterable[Cost]) -> Cost:
    """The sum of `costs` (a zero `Cost` for none)."""
    return sum(costs, Cost())


class Ledger:
    """A running `Cost` total that many threads add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = Cost()

    def add(self, cost: Cost) -> None:
        with self._lock:
            self._total = self._total + cost

    @property
    def total(self) -> Cost:
        with self._lock:
            return self._total
