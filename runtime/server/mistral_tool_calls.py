"""Mistral's tool calls since its v11 tokenizer (Mistral Small 3.1 and 3.2, Devstral,
Magistral, Ministral 3; `mistral_v11`): each call is its marker, the function's name and
its arguments' JSON, several calls one after another, content before the first:

    Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Some versions write the call's id between the name and the arguments,
`[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}`: it is read and dropped (the server
gives each call its own id, as for every format); a call without `[ARGS]` (the name
then `{`) is read too. `[TOOL_CALLS]`, `[CALL_ID]` and `[ARGS]` are special tokens of
those tokenizers, so a request read in this format is decoded with every special token
kept, and this format reads that text without the others (the stop token that ends the
answer, ...: `answer_decoding`), as decoding that skips them would have written it; the
content never shows a marker, whole or streamed.

A forced call and the calls after the trigger in "auto" (`forced`, `after_trigger`) are
written as `[TOOL_CALLS]NAME[ARGS]{...}`, the arguments valid against the tool's
parameter schema. A grammar matches text, and special tokens write none, so a
constrained answer spells its markers as ordinary text; they read the same either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sprig.runtime.constrained.json_schema import schema_to_regex
from sprig.runtime.json_limits import MAX_JSON_DEPTH, json_depth
from sprig.runtime.server.tool_calls import NO_PARAMETERS, ToolCall

CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
MARKERS = (CALLS, CALL_ID, ARGS)
_DECODER = json.JSONDecoder()
_WHITESPACE = " ?"  # between JSON tokens of a forced call: the spacing models write
# a call up to its arguments: the marker, the name, an optional call id, then `[ARGS]` or the arguments' `{`
_HEAD = re.compile(r"\[TOOL_CALLS\]\s*(?P<name>[^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?(?:\[ARGS\]\s*)?(?=\{)")


@dataclass(frozen=True)
class MistralToolFormat:
    """The `mistral_v11` format, a `tool_calls.CallFormat` (see the module docstring).
    It reads answers decoded with special tokens kept, the others' text removed
    (`answer_decoding.AnswerDecoding.read`)."""

    name: str = "mistral_v11"
    markers: tuple[str, ...] = MARKERS

    @property
    def trigger(self) -> str:
        return CALLS

    def for_tools(self, tools: list[dict[str, Any]]) -> MistralToolFormat:
        """This format (calls read alike whatever the tools)."""
        return self

    def call_start(self, text: str) -> int | None:
        at = text.find(CALLS)
        return at if at >= 0 else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could begin a marker."""
        return max((k for m in MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) if the text from the first `[TOOL_CALLS]` on is nothing but
        well-formed calls (each a name and a JSON object), else None."""
        start = self.call_start(text)
        if start is None:
            return None
        calls, at = [], start
        while at < len(text):
            head = _HEAD.match(text, at)
            end = None if head is None else _object_end(text, head.end())
            if end is None:
                return None
            calls.append(ToolCall(head["name"], text[head.end() : end]))
            at = end + len(text[end:]) - len(text[end:].lstrip())
        return unmarked(text[:start]).strip(), calls

    def split(self, text: str, finished: bool, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
        """As `ToolFormat.split`: content so far (without marker text), and once
        `finished` the calls, each of a function in `names` (None: any), or none at all
        and the whole answer is content. Every earlier content is a prefix of the final."""
        if finished:
            parsed = self.parse(text)
            if parsed is None or (names is not None and any(c.name not in names for c in parsed[1])):
                return unmarked(text).strip(), []
            return parsed
        start = self.call_start(text)
        return unmarked(text[: len(text) - self.held_back(text) if start is None else start]).strip(), []

    def marked_calls(self, answer: str) -> tuple[int, str] | None:
        """Where the calls of an unforced answer begin (its first `[TOOL_CALLS]`), and the
        text from there, as `partial_calls` reads it."""
        at = self.call_start(answer)
        return None if at is None else (at, answer[at:])

    def partial_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls of `text`, an answer of calls as `forced` writes them, as far as
        written: (name, the arguments' JSON text so far, whether it is complete) for each
        call whose arguments have begun. A later `text` extends what an earlier one gave,
        and a complete call's arguments are those `parse` gives."""
        calls: list[tuple[str, str, bool]] = []
        at = 0
        while (head := _HEAD.match(text, at)) is not None:
            end = _object_end(text, head.end())
            calls.append((head["name"], text[head.end() : len(text) if end is None else end], end is not None))
            if end is None:
                return calls
            at = end + len(text[end:]) - len(text[end:].lstrip())
        return calls

    def forced(self, tools: list[dict[str, Any]], several: bool = False) -> str:
        """The regex of an answer that is one call (`several`: one or more) of `tools`,
        arguments valid against each tool's parameter schema. Raises ValueError for a
        schema the constrained decoder cannot enforce."""
        return re.escape(CALLS) + self.after_trigger(tools, several)

    def after_trigger(self, tools: list[dict[str, Any]], several: bool) -> str:
        """The regex of what follows the first `[TOOL_CALLS]` in an answer of calls."""
        call = "(?:" + "|".join(_call_regex(tool) for tool in tools) + ")"
        return call + (f"(?:{re.escape(CALLS)}{call})*" if several else "")


def unmarked(text: str) -> str:
    """`text` without the format's marker names (what decoding that drops special
    tokens would have written)."""
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object opening at `text[start]` ends; None unless one does (or it
    nests deeper than `MAX_JSON_DEPTH`)."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return end if isinstance(value, dict) and json_depth(value) <= MAX_JSON_DEPTH else None


def _call_regex(tool: dict[str, Any]) -> str:
    fn = tool["function"]
    arguments = schema_to_regex(json.dumps(fn.get("parameters") or NO_PARAMETERS), _WHITESPACE)
    return re.escape(fn["name"]) + re.escape(ARGS) + arguments
