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

    With speculative decoding on the server, `verify_passes` counts the target's decode
    passes that emitted the completions' tokens (each pass emits the drafts it keeps plus
    one token of its own; the first token of each completion comes from its prefill),
    `drafts_proposed` the drafted tokens the target verified and `drafts_accepted` those
    it kept: SGLang's `spec_verify_ct`, `spec_num_proposed_drafts` and
    `spec_num_correct_drafts`. All three are 0 without speculation, where each completion
    token after the first takes a decode pass of its own. Over the OpenAI API only the
    drafts are known (`usage.completion_tokens_details`), not the passes.

    `retractions` counts the times the server took a request's KV slots back to make room
    for others (SGLang's `num_retractions`): each one recomputes the request's context
    later, work the token counts do not show. It stays 0 over the OpenAI API.
    """

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    wall_s: float = 0.0
    verify_passes: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    retractions: int = 0

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
            verify_passes=sum(int(m.get("spec_verify_ct", 0)) for m in items),
            drafts_proposed=sum(int(m.get("spec_num_proposed_drafts", 0)) for m in items),
            drafts_accepted=sum(int(m.get("spec_num_correct_drafts", 0)) for m in items),
            retractions=sum(int(m.get("num_retractions", 0)) for m in items),
        )

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def __str__(self) -> str:
        text = (f"{self.calls:,} calls: {self.prompt_tokens:,} prompt tokens ({self.cached_tokens:,} cached), "
                f"{self.completion_tokens:,} completion tokens; {self.latency_s:.2f} s of latency in "
                f"{self.wall_s:.2f} s wall")
        if self.verify_passes or self.drafts_proposed:
            drafts = (f"{self.drafts_accepted:,} of {self.drafts_proposed:,} drafts kept ({self.draft_accept_rate:.0%})"
                      if self.drafts_proposed else "nothing drafted")
            text += f"; speculation: {self.verify_passes:,} decode passes, {drafts}"
        if self.retractions:
            text += f"; {self.retractions:,} retraction{'s' if self.retractions != 1 else ''} to free KV slots"
        return text

    def with_wall(self, wall_s: float) -> Cost:
        """This cost with `wall_s` replaced by a measured elapsed time."""
        return dataclasses.replace(self, wall_s=wall_s)

    @property
    def cache_hit_rate(self) -> float:
        """Fraction of prompt tokens served from the prefix cache (0 when no prompt)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def draft_accept_rate(self) -> float:
        """Fraction of drafted tokens the target kept (0 when none was drafted)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0


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
