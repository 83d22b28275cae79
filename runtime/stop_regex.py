"""`stop_regex`: end a request when its generated text matches a pattern.

Patterns use Python `re` syntax; they run on the `regex` module (re-compatible in its
default VERSION0 mode), which adds the two things a stop condition on a growing text
needs: partial matches, so a streamed reply holds back only text that could still begin
a match, and a search timeout, the backstop against catastrophic backtracking.

Bounds (each documented in the README):
- at most `MAX_PATTERNS` patterns of at most `MAX_PATTERN_CHARS` characters each;
- a match must start within the last `WINDOW_CHARS` characters of the output text (the
  search never looks further back, so a step costs at most `WINDOW_CHARS` characters per
  pattern however long the output grows; lookbehinds see `CONTEXT_CHARS` more);
- one search may take `SEARCH_TIMEOUT_S` at most; past that the request ends, its
  finish_reason an abort naming the pattern.

A pattern that matches the empty string is refused: it would end every request at once.
The outcome depends only on the text (the same at every step however the text is
chunked), except for a search that times out, which only pathological patterns reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import regex

MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 256
WINDOW_CHARS = 256
CONTEXT_CHARS = 32
SEARCH_TIMEOUT_S = 0.05
_RULE = (f"a non-empty pattern or a list of at most {MAX_PATTERNS} patterns, each at most "
         f"{MAX_PATTERN_CHARS} characters")


def check_patterns(value: object) -> tuple[str, ...]:
    """`stop_regex` as given in `sampling_params` (a str, a list, or an empty list) as a
    de-duplicated tuple; raises `ValueError` naming `stop_regex` if it is malformed or a
    pattern does not compile."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) > MAX_PATTERNS:
        raise ValueError(f"stop_regex must be {_RULE}; got {value!r:.200}")
    for p in items:
        if not (isinstance(p, str) and 0 < len(p) <= MAX_PATTERN_CHARS):
            raise ValueError(f"stop_regex must be {_RULE}; got {p!r:.200}")
        _compile(p)
    return tuple(dict.fromkeys(items))


def _compile(pattern: str) -> regex.Pattern:
    try:
        compiled = regex.compile(pattern, regex.VERSION0)
    except (regex.error, OverflowError, RecursionError) as e:
        raise ValueError(f"stop_regex {pattern!r} does not compile: {e}") from None
    if compiled.search("") is not None:
        raise ValueError(f"stop_regex {pattern!r} matches the empty string, so it would stop every request at once")
    return compiled


class StopRegexTimeout(Exception):
    """A search ran past `SEARCH_TIMEOUT_S`."""

    def __init__(self, pattern: str) -> None:
        super().__init__(
            f"stop_regex {pattern!r} took more than {SEARCH_TIMEOUT_S * 1000:.0f} ms to search "
            f"{WINDOW_CHARS} characters (catastrophic backtracking); simplify the pattern"
        )
        self.pattern = pattern


@dataclass(frozen=True)
class Match:
    start: int
    end: int
    pattern: str


class StopPatterns:
    """Compiled `stop_regex` patterns, searched over the tail of a growing text.

    A `text` argument is the output text, or a tail of it at least `WINDOW_CHARS +
    CONTEXT_CHARS` characters long (then `^` cannot match at its cut start, which lies
    before the window). Offsets returned are into `text`.
    """

    def __init__(self, patterns: Sequence[str]) -> None:
        self._patterns = [(p, _compile(p)) for p in dict.fromkeys(patterns)]

    @staticmethod
    def _window_start(text: str) -> int:
        return max(0, len(text) - WINDOW_CHARS)

    def first_match(self, text: str) -> Match | None:
        """The match that ends first in the window (then the one starting first, then the
        first pattern given); None if no pattern matches. Raises `StopRegexTimeout`."""
        pos = self._window_start(text)
        best: Match | None = None
        for pattern, compiled in self._patterns:
            try:
                m = compiled.search(text, pos, timeout=SEARCH_TIMEOUT_S)
            except TimeoutError:
                raise StopRegexTimeout(pattern) from None
            if m is not None and (best is None or (m.end(), m.start()) < (best.end, best.start)):
                best = Match(m.start(), m.end(), pattern)
        return best

    def hold_from(self, text: str) -> int:
        """The first offset at which a longer text could still complete a match (a partial
        match begins there); `len(text)` if none. Assumes no complete match in `text`.
        Raises `StopRegexTimeout`."""
        pos = self._window_start(text)
        first = len(text)
        for pattern, compiled in self._patterns:
            try:
                m = compiled.search(text, pos, partial=True, timeout=SEARCH_TIMEOUT_S)
            except TimeoutError:
                raise StopRegexTimeout(pattern) from None
            if m is not None:
                first = min(first, m.start())
        return first
