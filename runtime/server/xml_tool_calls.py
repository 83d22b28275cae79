"""Qwen3-Coder's tool-call format (`qwen3_coder`, as SGLang and vLLM name its parser): a
call is XML-like text, a parameter per block, its value raw text rather than JSON:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Several calls follow one another (a newline between them); text before the first call is
the message's content. A value is the text between its parameter's tags, less one newline
on each side. It is read by the function's parameter schema (`XmlToolFormat.for_tools`):
a string parameter's value is the text as it is ("02139" stays a string), any other type's
is JSON text (an unparsable one stays a string, as a model's slip should not lose it). A
call's `arguments` is `json.dumps` of the parameters in the order written, so a call
streamed as it is written (`partial_calls`: each parameter once its closing tag is
written, `}` at `</function>`) adds up to the same string.

`forced` and `after_trigger` give the regex of calls whose values hold to the schemas:
a string value is any text without `</parameter>` (one of them for an enum), any other
JSON by its schema; the parameters come in the schema's order, the required ones always.
A string parameter limited by `pattern`, `format` or a length cannot be written as raw
text by a regex here: forcing a call of such a tool raises ValueError (the server's 400).
A value that holds `</parameter>` ends there: JSON text holding it (inside a string) is
the one call a forced grammar allows and this reader refuses (the answer then stays
content).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime import json_limits
from sprig.runtime.constrained.json_schema import schema_to_regex
from sprig.runtime.constrained.regex_text import text_without
from sprig.runtime.server.tool_calls import NO_PARAMETERS, ToolCall, split_answer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARAMETER_END = "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END = re.compile(r"\s*</function>")
_CALL_OPEN = re.compile(r"\s*" + re.escape(OPEN))
_CALL_END = re.compile(r"\s*" + re.escape(CLOSE))
_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength")
_JSON_WHITESPACE = " ?"
_ANNOTATIONS = {"description", "title", "default", "examples"}  # keys that do not limit a value


@dataclass(frozen=True)
class XmlToolFormat:
    """The `qwen3_coder` format, a `tool_calls.CallFormat`.
    `parameters`: each function's parameter schemas (`for_tools`), by which values are
    read; a function or parameter it lacks reads values as JSON where they parse."""

    name: str = "qwen3_coder"
    markers: tuple[str, ...] = (OPEN,)
    parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, hash=False)

    def for_tools(self, tools: list[dict[str, Any]]) -> XmlToolFormat:
        """This format reading values by `tools`' parameter schemas."""
        schemas = {t["function"]["name"]: (t["function"].get("parameters") or NO_PARAMETERS).get("properties") or {}
                   for t in tools}
        return dataclasses.replace(self, parameters=schemas)

    @property
    def trigger(self) -> str:
        return OPEN

    def call_start(self, text: str) -> int | None:
        at = text.find(OPEN)
        return at if at >= 0 else None

    def held_back(self, text: str) -> int:
        return max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) if the text from the first `<tool_call>` on is nothing but
        well-formed calls, else None."""
        start = self.call_start(text)
        if start is None:
            return None
        calls, at = [], start
        while True:
            opened = _CALL_OPEN.match(text, at)
            read = None if opened is None else self._call(text, opened.end())
            if read is None or not read[2]:
                return None
            name, members, _, at = read
            close = _CALL_END.match(text, at)
            if close is None:
                return None
            calls.append(ToolCall(name, _arguments(members, True)))
            at = close.end()
            if not text[at:].strip():
                return text[:start].strip(), calls

    def split(self, text: str, finished: bool, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
        """As `ToolFormat.split`: content so far, and once `finished` the calls, each of a
        function in `names` (None: any), or none at all."""
        return split_answer(self, text, finished, names)

    def marked_calls(self, answer: str) -> tuple[int, str] | None:
        """Where the calls of an unforced answer begin, and the text from there."""
        at = self.call_start(answer)
        return None if at is None else (at, answer[at:])

    def partial_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls of `text`, an answer of calls, as far as written: (name, arguments'
        JSON text so far, complete) for each call whose `<function=NAME>` is written."""
        calls: list[tuple[str, str, bool]] = []
        at = 0
        while (opened := _CALL_OPEN.match(text, at)) is not None:
            read = self._call(text, opened.end())
            if read is None:
                return calls
            name, members, complete, at = read
            calls.append((name, _arguments(members, complete), complete))
            close = _CALL_END.match(text, at)
            if not complete or close is None:
                return calls
            at = close.end()
        return calls

    def _call(self, text: str, at: int) -> tuple[str, list[tuple[str, Any]], bool, int] | None:
        """The call whose `<function=...>` starts at `at` (after blanks): its name, the
        parameters whose closing tag is written, whether `</function>` is, and where
        reading stopped; None before the name's line is whole."""
        head = _FUNCTION.match(text, at)
        if head is None:
            return None
        name, at = head[1].strip(), head.end()
        schemas = self.parameters.get(name, {})
        members: list[tuple[str, Any]] = []
        while True:
            if (end := _FUNCTION_END.match(text, at)) is not None:
                return name, members, True, end.end()
            opened = _PARAMETER.match(text, at)
            closed = -1 if opened is None else text.find(PARAMETER_END, opened.end())
            if closed < 0:
                return name, members, False, at
            key = opened[1].strip()
            members.append((key, _value(_unwrap(text[opened.end() : closed]), schemas.get(key))))
            at = closed + len(PARAMETER_END)

    def forced(self, tools: list[dict[str, Any]], several: bool = False) -> str:
        """The regex of an answer that is one call (`several`: one or more) of `tools`,
        values held to their schemas. Raises ValueError for a schema it cannot hold."""
        return re.escape(OPEN) + self.after_trigger(tools, several)

    def after_trigger(self, tools: list[dict[str, Any]], several: bool) -> str:
        """The regex of what follows the first `<tool_call>` in an answer of calls."""
        body = "(?:" + "|".join(_call_regex(tool) for tool in tools) + ")" + re.escape(CLOSE)
        more = f"(?:\\n{re.escape(OPEN)}{body})*" if several else ""
        return body + more


def _unwrap(value: str) -> str:
    """A value less the newline after its opening tag and the one before its closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _is_string(schema: Mapping[str, Any] | None) -> bool:
    if schema is None:
        return False
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return kind == "string" or (isinstance(kind, list) and kind == ["string"])


def _value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's value: the text itself for a string parameter, else the JSON it
    holds (the text where it holds none)."""
    if _is_string(schema):
        return text
    try:
        return json_limits.loads(text.strip(), "tool call arguments")
    except ValueError:
        return text


def _arguments(members: list[tuple[str, Any]], complete: bool) -> str:
    """The arguments' JSON text, `json.dumps` of the members in order (less its `}`
    while incomplete)."""
    inner = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in members)
    return "{" + inner + ("}" if complete else "")


def _call_regex(tool: dict[str, Any]) -> str:
    fn = tool["function"]
    schema = fn.get("parameters") or NO_PARAMETERS
    required = set(schema.get("required") or ())
    params = ""
    for key, prop in (schema.get("properties") or {}).items():
        one = f"<parameter={re.escape(key)}>\\n{_value_regex(key, prop)}\\n{re.escape(PARAMETER_END)}\\n"
        params += one if key in required else f"(?:{one})?"
    return f"\\n<function={re.escape(fn['name'])}>\\n{params}</function>\\n"


def _value_regex(key: str, schema: Mapping[str, Any]) -> str:
    """A value of `schema`: raw text for a string (one of an enum's), JSON otherwise, any
    text for a schema that says nothing of the value."""
    if _is_string(schema):
        if "const" in schema:
            return re.escape(str(schema["const"]))
        if "enum" in schema:
            return "(?:" + "|".join(re.escape(str(v)) for v in schema["enum"]) + ")"
        limits = [k for k in _STRING_LIMITS if k in schema]
        if limits:
            raise ValueError(f"parameter {key!r}: qwen3_coder writes strings as raw text, on which {limits[0]} "
                             "cannot be enforced")
        return text_without(PARAMETER_END)
    if set(schema) <= _ANNOTATIONS:
        return text_without(PARAMETER_END)
    return schema_to_regex(json.dumps(schema), _JSON_WHITESPACE)
