"""How many drafts each request verifies next: more while they are accepted, fewer when
they are not, none for a while when nothing has been accepted twice in a row (so a
drafter that guesses badly costs a big batch almost nothing)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 32


@dataclass
class DraftLength:
    """One request's adaptive draft length; `next()` is in [0, max_len]."""

    max_len: int
    length: int = 0  # 0: start at max_len
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without drafting

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length or self.max_len

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verification of `drafted` (> 0) drafts of which `accepted` were kept."""
        if accepted == drafted:
            self.length, self.misses = min(self.max_len, drafted + 1), 0
        elif accepted > 0:
            self.length, self.misses = accepted + 1, 0
        else:
            self.length, self.misses = 1, self.misses + 1
            if self.misses >= 2:
                self.pause = min(MAX_PAUSE_STEPS, 2 ** (self.misses - 1))
