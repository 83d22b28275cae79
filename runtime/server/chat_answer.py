"""A chat completion's generated text as OpenAI's assistant message: the reasoning split
off (`reasoning`), then tool calls parsed out of the answer (`tool_calls`); whole, or as
stream deltas that only ever append.

Calls stream as they are written, as OpenAI streams them (each call's id and name once
written, then its arguments' JSON text in pieces), where the grammar makes them calls: a
forced call (`tool_choice` "required" or a named function) from its first token, and a
call in "auto" once the format's marker is written (the answer is constrained from there,
`constraint_trigger`). Their arguments are complete unless the output was cut short
(`max_tokens`); then the last call holds the arguments written so far, whole and streamed
alike, and the finish reason says why it ended. A call in "auto" without that constraint
(a marker the text does not show, tools with free-form parameters) streams whole, in the
last delta: until it has parsed it may yet turn out to be text. A harmony answer (gpt-oss,
`harmony`) is read as a whole: reasoning, content and calls from its messages; its calls
stream as written, the header naming each before its arguments begin."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.server.answer_decoding import AnswerDecoding
from sprig.runtime.server.harmony import HarmonyReader
from sprig.runtime.server.reasoning import Phase, ReasoningFormat
from sprig.runtime.server.tool_calls import CallFormat, ToolCall, new_call_id


@dataclass(frozen=True)
class AnswerFormat:
    """`reasoning`: the format split off as `reasoning_content` (None: not split), with
    the `phase` the output starts in; `tools`: the tool-call format parsed out of the
    answer (None: plain content), whose calls must name one of `tool_names`; `forced`:
    the answer is constrained to one call; `gated`: it is constrained to calls from the
    format's marker on (both stream their calls as written); `one_call`: keep only the
    first call (`parallel_tool_calls: false`); `harmony`: the output is harmony messages,
    read by it (then `reasoning` and `tools` are None); `decoding`: how the output was
    decoded, and what of its text is read out before anything else reads it."""

    reasoning: ReasoningFormat | None
    phase: Phase
    tools: CallFormat | None
    tool_names: frozenset[str] = frozenset()
    forced: bool = False
    one_call: bool = False
    gated: bool = False
    harmony: HarmonyReader | None = None
    decoding: AnswerDecoding = field(default_factory=AnswerDecoding)

    @property
    def splits_reasoning(self) -> bool:
        """Whether the message has a `reasoning_content` field."""
        return self.reasoning is not None or (self.harmony is not None and self.harmony.split_reasoning)

    @property
    def plain(self) -> bool:
        """Whether the output is all content, passed through as it arrives."""
        return (self.reasoning is None and self.tools is None and self.harmony is None
                and self.decoding.dropped is None)

    def split_reasoning(self, text: str, finished: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of the output so far (`ReasoningFormat.split`)."""
        return (None, text) if self.reasoning is None else self.reasoning.split(text, self.phase, finished)

    def parts(self, text: str, finished: bool) -> tuple[str | None, str, list[tuple[str, str, bool]] | None,
                                                       list[ToolCall]]:
        """(reasoning, content, calls as written so far, calls parsed whole) of the output
        so far: calls either stream as written (`written_calls`, a harmony answer's),
        or arrive whole once the answer has finished (`calls`); the other is None or []."""
        if self.harmony is not None:
            reading = self.harmony.read(text, finished)
            written = reading.calls[:1] if self.one_call else reading.calls
            return reading.reasoning, reading.content, written or None, []
        reasoning, answer = self.split_reasoning(self.decoding.read(text), finished)
        written = self.written_calls(answer)
        if written is not None:
            return reasoning, written[0], written[1], []
        content, calls = self.calls(answer, finished)
        return reasoning, content, None, calls

    def written_calls(self, answer: str) -> tuple[str, list[tuple[str, str, bool]]] | None:
        """(content, calls as written so far: name, arguments' JSON text, whether they are
        complete) of an answer whose calls the grammar makes calls (`forced`, `gated`),
        once the first call's arguments have begun (`CallFormat.partial_calls`); None
        otherwise (then `calls` reads the answer). The content before the calls reads as
        a finished answer without calls would (`CallFormat.split`: no marker text)."""
        if self.tools is None or not (self.forced or self.gated):
            return None
        content, text = "", answer
        if self.gated:
            marked = self.tools.marked_calls(answer)
            if marked is None:
                return None
            content, text = self.tools.split(answer[: marked[0]], True, frozenset())[0], marked[1]
        calls = self.tools.partial_calls(text)
        return (content, calls[:1] if self.one_call else calls) if calls else None

    def calls(self, answer: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content, tool calls) of an answer the model wrote (calls only once finished)."""
        if self.tools is None:
            return answer, []
        content, calls = self.tools.split(answer, finished, self.tool_names)
        return content, calls[:1] if self.one_call else calls

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The finished output as an assistant message, and whether it ends in complete
        tool calls (finish reason "tool_calls")."""
        reasoning, content, written, calls = self.parts(text, True)
        if written is not None:
            calls = [ToolCall(name, arguments) for name, arguments, _ in written]
        complete = bool(calls) and (written is None or all(done for *_, done in written))
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.splits_reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, complete


@dataclass
class DeltaState:
    """What one streamed choice has sent so far. Plain content passes through as it
    arrives; the reasoning and tool-call parsers read the text so far (`text`), kept
    only for them. `call_ids` and `args_chars`: the id of each call streamed as written,
    and how much of its arguments went out."""

    text: str = ""
    reasoning_chars: int = 0
    content_chars: int = 0
    call_ids: list[str] = field(default_factory=list)
    args_chars: list[int] = field(default_factory=list)

    def delta(self, fmt: AnswerFormat, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """The next delta's message fields, given the `text` just generated (reasoning
        first; content only once the reasoning has ended, except in harmony, where each
        comes as its messages do), and whether the answer has ended in complete tool calls."""
        if fmt.plain:
            return ({"content": text} if text else {}), False
        self.text += text
        reasoning, content, written, calls = fmt.parts(self.text, finished)
        body: dict[str, Any] = {}
        if reasoning and len(reasoning) > self.reasoning_chars:
            body["reasoning_content"] = reasoning[self.reasoning_chars :]
            self.reasoning_chars = len(reasoning)
        if len(content) > self.content_chars:
            body["content"] = content[self.content_chars :]
            self.content_chars = len(content)
        if written is not None:
            pieces = [self._piece(i, *call) for i, call in enumerate(written)]
            if any(pieces):
                body["tool_calls"] = [p for p in pieces if p]
            return body, finished and all(done for *_, done in written)
        if calls:
            body["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
        return body, bool(calls)

    def _piece(self, index: int, name: str, arguments: str, _complete: bool) -> dict[str, Any] | None:
        """The delta of call `index` written as far as `arguments`: id, name and arguments
        the first time, then what the arguments added (None if nothing)."""
        if index == len(self.call_ids):
            self.call_ids.append(new_call_id())
            self.args_chars.append(len(arguments))
            return {"index": index, "id": self.call_ids[index], "type": "function",
                    "function": {"name": name, "arguments": arguments}}
        if len(arguments) == self.args_chars[index]:
            return None
        piece = {"index": index, "function": {"arguments": arguments[self.args_chars[index] :]}}
        self.args_chars[index] = len(arguments)
        return piece
