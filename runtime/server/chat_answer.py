"""A chat completion's generated text as OpenAI's assistant message: the reasoning split
off (`reasoning`), then tool calls parsed out of the answer (`tool_calls`); whole, or as
stream deltas that only ever append."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sprig.runtime.server.reasoning import Phase, ReasoningFormat
from sprig.runtime.server.tool_calls import ToolCall, ToolFormat


@dataclass(frozen=True)
class AnswerFormat:
    """`reasoning`: the format split off as `reasoning_content` (None: not split), with
    the `phase` the output starts in; `tools`: the tool-call format parsed out of the
    answer (None: plain content), whose calls must name one of `tool_names`; `one_call`:
    keep only the first call (`parallel_tool_calls: false`)."""

    reasoning: ReasoningFormat | None
    phase: Phase
    tools: ToolFormat | None
    tool_names: frozenset[str] = frozenset()
    one_call: bool = False

    def parts(self, text: str, finished: bool) -> tuple[str | None, str, list[ToolCall]]:
        """(reasoning, content, tool calls) of the output so far (calls only once finished)."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.phase, finished)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.split(content, finished, self.tool_names)
        return reasoning, content, calls[:1] if self.one_call else calls

    def message(self, text: str) -> dict[str, Any]:
        """The finished output as an assistant message."""
        reasoning, content, calls = self.parts(text, True)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message


@dataclass
class DeltaState:
    """What one streamed choice has sent so far. Plain content passes through as it
    arrives; the reasoning and tool-call parsers read the text so far (`text`), kept
    only for them."""

    text: str = ""
    reasoning_chars: int = 0
    content_chars: int = 0

    def delta(self, fmt: AnswerFormat, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """The next delta's message fields, given the `text` just generated (reasoning
        first; content only once the reasoning has ended) and whether the answer holds
        tool calls (then sent whole)."""
        if fmt.reasoning is None and fmt.tools is None:
            return ({"content": text} if text else {}), False
        self.text += text
        reasoning, content, calls = fmt.parts(self.text, finished)
        body: dict[str, Any] = {}
        if reasoning and len(reasoning) > self.reasoning_chars:
            body["reasoning_content"] = reasoning[self.reasoning_chars :]
            self.reasoning_chars = len(reasoning)
        if len(content) > self.content_chars:
            body["content"] = content[self.content_chars :]
            self.content_chars = len(content)
        if calls:
            body["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        return body, bool(calls)
