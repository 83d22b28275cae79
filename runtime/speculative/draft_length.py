"""How many drafts each request verifies next, and what they are expected to yield: more
while they are accepted, fewer when they are not, none for a while after two misses in a
row."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 32
RATE_DECAY = 0.5  # weight of the past in the acceptance-rate average
START_RATE = 0.5  # assumed acceptance of a request's first drafts


@dataclass
class DraftLength:
    """One request's adaptive draft length; `next()` is in [0, max_len]."""

    max_len: int
    length: int = 0  # 0: start at max_len
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting
    rate: float = START_RATE  # running average of the share of drafts accepted

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length or self.max_len

    def expected(self, drafts: int) -> float:
        """Tokens `drafts` drafts are expected to add: each is kept only after the ones before it."""
        return sum(self.rate ** (i + 1) for i in range(drafts))

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification of `drafted` (> 0) drafts of which `accepted` were kept."""
        self.rate = RATE_DECAY * self.rate + (1 - RATE_DECAY) * accepted / drafted
        if accepted == drafted:
            self.length, self.misses = min(self.max_len, drafted + 1), 0
        elif accepted:
            self.length, self.misses = accepted + 1, 0
        else:
            self.length = 1
            self.missed()

    def missed(self) -> None:
        """A verification kept nothing, or the drafter had nothing to propose: after two
        in a row, pause for 2, 4, 8 ... steps."""
        self.misses += 1
        if self.misses >= 2:
            self.pause = min(MAX_PAUSE_STEPS, 2 ** (self.misses - 1))
