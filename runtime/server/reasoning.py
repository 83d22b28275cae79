"""Reasoning models' thinking, split from their answer: `--reasoning-parser`.

Qwen3 and DeepSeek-R1 write `<think> ... </think>` before the answer, as text. Mistral's
reasoning models since Magistral Small and Medium 2507 (tokenizer v13: Magistral 1.1, 1.2,
...) write `[THINK] ... [/THINK]`, both special tokens (`mistral`; Magistral 2506 wrote
`<think>` as text, which `qwen3` reads): such a request is decoded with them kept
(`answer_decoding`), and a marker is never shown, not even one out of place, as decoding
that skips special tokens would have dropped it. gpt-oss's harmony format, whose analysis
channel is the reasoning, is read in `server.harmony`. The chat route
sends the reasoning as `message.reasoning_content` (streamed: `delta.reasoning_content`,
with content deltas only once the reasoning has ended) and the rest as `content`; and it
asks the scheduler to start any constraint (response_format, a forced tool call, ...)
only after the end marker (`SamplingParams.reasoning_end`), so the answer, not the
thinking, matches it.

Where a request's output starts is read from its rendered prompt (`ReasoningFormat.phase`):
- the prompt ends with a closed think block (Qwen3 with `enable_thinking=false`): the
  output is all answer;
- the prompt opened one and left it open (DeepSeek-R1's and QwQ's templates): the output
  starts inside the reasoning;
- otherwise the format decides: a `qwen3` or `mistral` model may open the reasoning
  itself or answer at once (Magistral thinks as its system prompt asks, whose default
  spells a closed `[THINK]...[/THINK]` template before the prompt's end); a `deepseek-r1`
  output is reasoning until `</think>` (a leading `<think>` dropped).

Invariant of `split`: while the output is unfinished, every reasoning and content it
returns is a prefix of what it returns for the finished output, so streamed deltas only
append.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Phase(Enum):
    """Where a request's output starts."""

    ANSWER = "answer"
    THINKING = "thinking"
    MAYBE = "maybe"  # the output may open the reasoning with the start marker


@dataclass(frozen=True)
class ReasoningFormat:
    """`start` and `end` mark the reasoning; `special`: they are special tokens, kept in
    the text this format reads (`answer_decoding`) and never part of what it returns."""

    name: str
    start: str
    end: str
    always_thinks: bool  # with no think block in the prompt, the output starts inside one
    special: bool = False

    @property
    def markers(self) -> tuple[str, str]:
        return self.start, self.end

    def phase(self, prompt: str) -> Phase:
        if prompt.rstrip().endswith(self.end):
            return Phase.ANSWER
        if prompt.rfind(self.start) > prompt.rfind(self.end) or self.always_thinks:
            return Phase.THINKING
        return Phase.MAYBE

    def sampling(self, phase: Phase) -> dict[str, Any]:
        """The sampling parameters that defer a constraint past the reasoning."""
        if phase is Phase.ANSWER:
            return {}
        return {"reasoning_start": self.start if phase is Phase.MAYBE else None, "reasoning_end": self.end}

    def split(self, text: str, phase: Phase, finished: bool) -> tuple[str | None, str]:
        """(reasoning, content) of an output so far; reasoning is None when the output has
        none. Unfinished, what could still be the start of a marker, and blanks that may
        yet turn out to end the reasoning, are held back. A `special` format's parts hold
        no marker text."""
        reasoning, content = self._split(text, phase, finished)
        if not self.special:
            return reasoning, content
        return (None if reasoning is None else self._unmarked(reasoning, finished).strip(),
                self._unmarked(content, finished).lstrip())

    def _split(self, text: str, phase: Phase, finished: bool) -> tuple[str | None, str]:
        if phase is Phase.ANSWER:
            return None, text
        body = text.lstrip()
        if not finished and self.start.startswith(body):  # nothing yet, or maybe the start marker
            return None if phase is Phase.MAYBE else "", ""
        opened = body.startswith(self.start)
        if phase is Phase.MAYBE and not opened:
            return None, text
        if opened:
            body = body[len(self.start) :]
        at = body.find(self.end)
        if at >= 0:
            return body[:at].strip(), body[at + len(self.end) :].lstrip()
        if not finished:
            body = body[: len(body) - _partial_marker(body, self.end)]
        return body.strip(), ""

    def _unmarked(self, part: str, finished: bool) -> str:
        """`part` without the markers (unfinished, without an end that may begin one)."""
        if not finished:
            part = part[: len(part) - max(_partial_marker(part, m) for m in self.markers)]
        for marker in self.markers:
            part = part.replace(marker, "")
        return part


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


_THINK = ("<think>", "</think>")
REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", *_THINK, always_thinks=False),
    "deepseek-r1": ReasoningFormat("deepseek-r1", *_THINK, always_thinks=True),
    "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]", always_thinks=False, special=True),
}
