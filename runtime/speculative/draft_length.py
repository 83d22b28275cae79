"""How many drafts each request verifies next, and what they are expected to yield: as
many as its acceptance rate makes worth checking, none for a while after two misses in a
row or after its drafter had nothing to propose."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 32
EMPTY_PAUSE_STEPS = 4  # steps a request waits to ask again a drafter that had nothing to propose
RATE_DECAY = 0.5  # per verification, the weight of the past in a request's acceptance rate
START_RATE = 0.5  # assumed acceptance of a request's first drafts
MIN_WORTH = 0.2  # a request's n-th draft is proposed only if it is expected to add this many tokens (rate ** n)


@dataclass
class AcceptanceRate:
    """A running estimate of the chance that a draft is kept. Drafts are checked in order
    until one is rejected, so a verification of `drafted` drafts that kept `accepted`
    checked `accepted + 1` of them (all `drafted` when none was rejected): the rate is
    kept / checked, each a sum over verifications weighted by `decay` per verification
    since (`weight` checks at the starting rate stand for what came before). Counting
    `accepted / drafted` instead would take the drafts never checked after a rejection for
    rejected ones, and underrate a drafter the more it drafts past its first miss."""

    kept: float
    checked: float
    decay: float

    @classmethod
    def starting_at(cls, rate: float, decay: float, weight: float = 1.0) -> AcceptanceRate:
        return cls(rate * weight, weight, decay)

    @property
    def rate(self) -> float:
        return self.kept / self.checked

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification of `drafted` (> 0) drafts of which `accepted` were kept."""
        self.kept = self.decay * self.kept + accepted
        self.checked = self.decay * self.checked + accepted + (accepted < drafted)


@dataclass
class DraftLength:
    """One request's adaptive draft length; `next()` is in [0, max_len]."""

    max_len: int
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting
    rate: float = START_RATE  # the chance that a draft is kept, at the start (then `acceptance.rate`)

    def __post_init__(self) -> None:
        self.acceptance = AcceptanceRate.starting_at(self.rate, RATE_DECAY)

    def next(self) -> int:
        """The drafts worth verifying next: the n-th is kept only if the n - 1 before it
        were, with chance rate ** n, and only those with rate ** n >= `MIN_WORTH` count
        (at least one, at most `max_len`; the cost gate `cost.draft_cap` may verify fewer)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        rate, n = self.acceptance.rate, 1
        while n < self.max_len and rate ** (n + 1) >= MIN_WORTH:
            n += 1
        return n

    def expected(self, drafts: int) -> float:
        """Tokens `drafts` drafts are expected to add: each is kept only after the ones before it."""
        rate = self.acceptance.rate
        return sum(rate ** (i + 1) for i in range(drafts))

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification of `drafted` (> 0) drafts of which `accepted` were kept."""
        self.acceptance.update(drafted, accepted)
        if accepted:
            self.misses = 0
        else:
            self.missed()

    def empty(self) -> None:
        """The drafter had nothing to propose: ask it again after `EMPTY_PAUSE_STEPS` (its
        context has to grow before it can find anything new)."""
        self.pause = max(self.pause, EMPTY_PAUSE_STEPS)

    def missed(self) -> None:
        """A verification kept nothing, or drafting was worth it and the request got no
        drafts: after two in a row, pause for 2, 4, 8 ... steps."""
        self.misses += 1
        if self.misses >= 2:
            self.pause = min(MAX_PAUSE_STEPS, 2 ** (self.misses - 1))
