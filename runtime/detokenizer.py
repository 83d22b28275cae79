"""Incremental, UTF-8-safe detokenization with stop strings and stop patterns, one state
per request.

Used in-process by the offline engine and by the server's detokenizer process. Three
layers, each usable alone:

- `IncrementalDecoder`: token ids in, complete text out, re-decoding only a short window.
- `StopMatcher`: text in, visible text out; finds stop strings and `stop_regex` matches
  across chunk boundaries and holds back any suffix that might still become one.
- `RequestDetokenizer`: both, driven by `step(new_ids, finished) -> DecodeDelta`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sprig.runtime.stop_regex import (
    CONTEXT_CHARS,
    WINDOW_CHARS,
    StopPatterns,
    StopRegexTimeout,
    check_patterns,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sprig.runtime.sampling import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context (spacing, merges)


class IncrementalDecoder:
    """Streams the text of generated token ids, never splitting a UTF-8 character.

    Invariant (property-tested): with `ctx` the context actually used (the last
    `context_tokens` prompt ids, or none if they decode to text ending in U+FFFD),
    ``"".join(push(c) for c in chunks) + flush() == decode(ctx + out)[len(decode(ctx)):]``;
    with no context that is exactly ``decode(out)``. For byte-level BPE this holds for any
    ids; for byte-fallback tokenizers it holds when every run of byte tokens is valid UTF-8
    (an invalid run turns the whole run into U+FFFD, retroactively).

    Technique (prefix/read offsets): `_window[:_read]` is text already emitted, kept only
    as left context; `_window[_read:]` is pending. A push decodes the window, emits what
    lies past the emitted prefix unless it ends in U+FFFD (an incomplete byte sequence),
    and then drops everything left of the newly emitted tokens, so each push costs
    O(new tokens + tokens of the last emission). Tokens that add no text (skipped special
    tokens) or leave it ending in U+FFFD stay pending until some text completes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context_tokens: int = PROMPT_CONTEXT_TOKENS,
    ) -> None:
        self._tokenizer = tokenizer
        # transformers 5 ignores spaces_between_special_tokens; slow tokenizers of
        # transformers 4 and remote-code tokenizers honour it, so it is passed through.
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        context = list(prompt_ids[max(len(prompt_ids) - context_tokens, 0) :])
        self._prefix_text = self._decode(context)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):  # the prompt ends mid-character
            context, self._prefix_text = [], ""
        self._window = context
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly completed text (possibly "")."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        return self._emit(self._decode(self._window), final=False)

    def flush(self) -> str:
        """Return whatever is still held back, incomplete characters included (as U+FFFD)."""
        return self._emit(self._decode(self._window), final=True)

    def _emit(self, text: str, *, final: bool) -> str:
        if len(text) <= len(self._prefix_text) or (not final and text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = text[len(self._prefix_text) :]
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta


def _check_stops(stop: tuple[str, ...]) -> None:
    if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a tuple of non-empty strings, got {stop!r}")


class StopMatcher:
    """Cuts a text stream at the first stop string or `stop_regex` match, however the
    stream is chunked.

    Each push searches the text so far: stop strings anywhere in it, patterns (`re`
    syntax, `regex.search`) in its last `stop_regex.WINDOW_CHARS` characters. Of the
    matches found, the one ending first wins (then the longer; a stop string before a
    pattern). Visible output ends at the start of the match, or at its end with
    `no_stop_trim`. Invariants: text once returned is never retracted (a suffix that could
    begin a stop string, or a partial match of a pattern, is held back until it cannot);
    for any chunking in which no push but the last completes a match, the concatenated
    output equals ``push(whole, final=True)`` (always, with stop strings alone: they are
    found at the smallest end offset whatever the chunking). The scheduler and the
    detokenizer push at token boundaries and the request ends at the first push that
    matches, so both see the same match. A pattern search that times out ends the text
    where it is, with `error` set (see `sprig.runtime.stop_regex`).
    """

    def __init__(
        self, stop: tuple[str, ...], no_stop_trim: bool = False, stop_regex: tuple[str, ...] = ()
    ) -> None:
        _check_stops(stop)
        self._stop = tuple(dict.fromkeys(stop))
        self._no_stop_trim = no_stop_trim
        self._patterns = StopPatterns(stop_regex) if stop_regex else None
        self._tail = ""  # with patterns: the last characters of all text pushed (held included)
        self._held = ""
        self._done = False
        self.matched: str | None = None
        self.error: str | None = None

    def push(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """Feed text; return (newly visible text, the stop string or pattern matched now
        or None). After a match, an error, or `final`, the matcher is done and returns
        ("", None)."""
        if self._done:
            return "", None
        held = self._held + text
        tail = self._tail + text if self._patterns is not None else held
        base = len(tail) - len(held)  # where the held text begins in `tail`
        self._held = ""
        self._done = final
        try:
            best = self._first_stop(tail, base)
            keep = 0 if final or best is not None else self._hold_len(tail, base)
        except StopRegexTimeout as e:
            self.error, self._done = str(e), True
            return held, None
        if best is not None:
            end, start, self.matched = best
            self._done = True
            return tail[base : max(base, end if self._no_stop_trim else start)], self.matched
        self._held = held[len(held) - keep :] if keep else ""
        if self._patterns is not None:
            self._tail = tail[-max(WINDOW_CHARS + CONTEXT_CHARS, keep) :]
        return held[: len(held) - keep], None

    def _first_stop(self, tail: str, base: int) -> tuple[int, int, str] | None:
        """(end, start, matched) in `tail` of the stop completed first. Stop strings are
        searched in the held text only: emitted text never holds one's beginning."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = tail.find(s, base)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        found = self._patterns.first_match(tail) if self._patterns is not None else None
        if found is not None and (best is None or (found.end, found.start) < best[:2]):
            best = (found.end, found.start, found.pattern)
        return best

    def _hold_len(self, tail: str, base: int) -> int:
        """How many trailing characters of the held text may still begin a stop."""
        keep = self._partial_stop_len(tail[base:])
        if self._patterns is not None:
            keep = max(keep, len(tail) - max(base, self._patterns.hold_from(tail)))
        return keep

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


@dataclass(frozen=True)
class DetokenizeConfig:
    """The sampling parameters that shape the output text of one request."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    stop_regex: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_stops(self.stop)
        object.__setattr__(self, "stop_regex", check_patterns(self.stop_regex))

    @classmethod
    def of(cls, params: SamplingParams) -> DetokenizeConfig:
        """The text-shaping fields of a request's `SamplingParams`."""
        return cls(
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            no_stop_trim=params.no_stop_trim,
            stop_regex=params.stop_regex,
        )


@dataclass(frozen=True)
class DecodeDelta:
    """What one step adds to the visible text; `finished` is set on the last delta.
    `stop_error` says why the text ended early when a stop_regex search timed out."""

    text_delta: str
    stop_matched: str | None = None
    finished: bool = False
    stop_error: str | None = None


class RequestDetokenizer:
    """Per-request detokenization: incremental decode, then stop trimming (stop strings
    and `stop_regex`).

    Invariant: the concatenated `text_delta`s equal the non-streaming output, i.e. the
    stop-trimmed decode of all ids given before the request finished. Once finished (by
    `finished=True`, a stop match or a `stop_error`) every further step returns an empty
    delta; the caller should end generation when `stop_matched` or `stop_error` is set.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int] = (),
        config: DetokenizeConfig | None = None,
    ) -> None:
        config = config or DetokenizeConfig()
        self._decoder = IncrementalDecoder(
            tokenizer,
            prompt_ids,
            skip_special_tokens=config.skip_special_tokens,
            spaces_between_special_tokens=config.spaces_between_special_tokens,
        )
        self._stop = StopMatcher(config.stop, config.no_stop_trim, config.stop_regex)
        self.finished = False

    def step(self, new_ids: Sequence[int], finished: bool = False) -> DecodeDelta:
        """Consume generated ids; `finished` means no more ids will come (flushes)."""
        if self.finished:
            return DecodeDelta("", None, True)
        text = self._decoder.push(new_ids)
        if finished:
            text += self._decoder.flush()
        visible, matched = self._stop.push(text, final=finished)
        error = self._stop.error
        self.finished = finished or matched is not None or error is not None
        return DecodeDelta(visible, matched, self.finished, error)


def decode_tokens_for_logprobs(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """Each token's own text, special tokens included (`return_text_in_logprobs`).

    A token holding part of a multi-byte character decodes to U+FFFD, and SentencePiece
    tokenizers drop a token's leading space when it is decoded alone.
    """
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
