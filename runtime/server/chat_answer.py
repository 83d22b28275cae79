"""A chat completion's generated text as OpenAI's assistant message: the reasoning split
off (`reasoning`), then tool calls parsed out of the answer (`tool_calls`); whole, or as
stream deltas that only ever append.

A call the model writes on its own (`tool_choice` "auto") streams whole, in the last
delta: until it has parsed it may yet turn out to be text. A forced call (`tool_choice`
"required" or a named function), which the grammar makes a call from its first token,
streams as it is written: its name once written, then its arguments' JSON text in pieces,
as OpenAI streams calls. Its arguments are complete unless the output was cut short
(`max_tokens`); then the call holds the arguments written so far, whole and streamed
alike, and the finish reason says why it ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sprig.runtime.server.reasoning import Phase, ReasoningFormat
from sprig.runtime.server.tool_calls import ToolCall, ToolFormat, new_call_id


@dataclass(frozen=True)
class AnswerFormat:
    """`reasoning`: the format split off as `reasoning_content` (None: not split), with
    the `phase` the output starts in; `tools`: the tool-call format parsed out of the
    answer (None: plain content), whose calls must name one of `tool_names`; `forced`:
    the answer is constrained to one call, streamed as it is written; `one_call`: keep
    only the first call (`parallel_tool_calls: false`)."""

    reasoning: ReasoningFormat | None
    phase: Phase
    tools: ToolFormat | None
    tool_names: frozenset[str] = frozenset()
    forced: bool = False
    one_call: bool = False

    def split_reasoning(self, text: str, finished: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of the output so far (`ReasoningFormat.split`)."""
        return (None, text) if self.reasoning is None else self.reasoning.split(text, self.phase, finished)

    def forced_call(self, answer: str) -> tuple[str, str, bool] | None:
        """A forced answer's call as written so far: (name, arguments' JSON text, whether
        they are complete), once its arguments have begun (`ToolFormat.partial_call`);
        None otherwise, and for an answer that is no forced call."""
        return self.tools.partial_call(answer) if self.forced and self.tools is not None else None

    def calls(self, answer: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content, tool calls) of an answer the model wrote (calls only once finished)."""
        if self.tools is None:
            return answer, []
        content, calls = self.tools.split(answer, finished, self.tool_names)
        return content, calls[:1] if self.one_call else calls

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The finished output as an assistant message, and whether it ends in complete
        tool calls (finish reason "tool_calls")."""
        reasoning, answer = self.split_reasoning(text, True)
        forced = self.forced_call(answer)
        if forced is not None:
            content, calls, complete = "", [ToolCall(forced[0], forced[1])], forced[2]
        else:
            content, calls = self.calls(answer, True)
            complete = bool(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, complete


@dataclass
class DeltaState:
    """What one streamed choice has sent so far. Plain content passes through as it
    arrives; the reasoning and tool-call parsers read the text so far (`text`), kept
    only for them. `call_id` and `args_chars`: a forced call's id and how much of its
    arguments went out."""

    text: str = ""
    reasoning_chars: int = 0
    content_chars: int = 0
    call_id: str | None = None
    args_chars: int = 0

    def delta(self, fmt: AnswerFormat, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """The next delta's message fields, given the `text` just generated (reasoning
        first; content only once the reasoning has ended), and whether the answer has
        ended in complete tool calls."""
        if fmt.reasoning is None and fmt.tools is None:
            return ({"content": text} if text else {}), False
        self.text += text
        reasoning, answer = fmt.split_reasoning(self.text, finished)
        body: dict[str, Any] = {}
        if reasoning and len(reasoning) > self.reasoning_chars:
            body["reasoning_content"] = reasoning[self.reasoning_chars :]
            self.reasoning_chars = len(reasoning)
        forced = fmt.forced_call(answer)
        if forced is not None:
            name, arguments, complete = forced
            if self.call_id is None:
                self.call_id = new_call_id()
                body["tool_calls"] = [{"index": 0, "id": self.call_id, "type": "function",
                                       "function": {"name": name, "arguments": arguments}}]
            elif len(arguments) > self.args_chars:
                body["tool_calls"] = [{"index": 0, "function": {"arguments": arguments[self.args_chars :]}}]
            self.args_chars = len(arguments)
            return body, complete and finished
        content, calls = fmt.calls(answer, finished)
        if len(content) > self.content_chars:
            body["content"] = content[self.content_chars :]
            self.content_chars = len(content)
        if calls:
            body["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        return body, bool(calls)
