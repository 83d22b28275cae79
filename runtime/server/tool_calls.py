"""Tool calls in a chat model's answer: the text formats chat templates teach, parsed
into OpenAI's `tool_calls`, and the regex that makes a model call a tool when
`tool_choice` requires one.

The JSON formats (`FORMATS`; `tool_formats` holds every format and picks one from a chat
template's text):
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  repeated for several calls; text before the first call is the message's content;
- `llama3` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, several
  joined by `;`, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (before
  Mistral's v11 tokenizer; the v11 format, `[TOOL_CALLS]NAME[ARGS]{...}`, is
  `mistral_tool_calls`).
OpenAI's harmony format (gpt-oss: `<|channel|>commentary to=functions.NAME ...`) is read as
whole messages, with its reasoning, in `server.harmony` (a template that writes `<|channel|>`
and `<|start|>` speaks it), not here.

A forced call on a model whose template teaches none of them is written in `BARE_JSON`:
the call object alone, `{"name": ..., "arguments": {...}}` (OpenAI's own shape, which a
model that knows no tool format reads as plain JSON, and no marker text to force). An
unforced answer on such a model stays plain content.

Invariant: `parse` returns calls only when the whole tool-call part is well-formed (every
call a JSON object with a string name and an object of arguments); otherwise the answer
is plain content, never a half-parsed call. A chat answer's calls also name only the
request's tools (`split` with `names`): a call of any other function leaves the answer
plain content too, as OpenAI never returns a call of a function it was not given. A
call's `arguments` is the JSON text the model wrote, so a call streamed as it is
written (`partial_calls`) adds up to the same string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sprig.runtime import json_limits
from sprig.runtime.constrained.json_schema import admits_free_form, schema_to_regex
from sprig.runtime.constrained.regex_text import lark_grammar
from sprig.runtime.json_limits import MAX_JSON_DEPTH, json_depth
from sprig.runtime.sampling.params import MAX_EBNF_CHARS
from sprig.runtime.server.constraints import Constraint, response_format_regex
from sprig.runtime.server.errors import ApiError

_DECODER = json.JSONDecoder()
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none (OpenAI)
_WHITESPACE = " ?"  # between JSON tokens of a forced call: the spacing models write


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as the model wrote its JSON text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry (with `index` in a stream's delta)."""
        call = {"id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallFormat(Protocol):
    """What the server asks of a tool-call format (`ToolFormat`, the JSON ones;
    `xml_tool_calls.XmlToolFormat`, `mistral_tool_calls.MistralToolFormat`): the markers that open calls, reading an answer's
    calls whole (`split`) and as written (`marked_calls`, `partial_calls`), and the regex
    of calls of given tools (`forced`, `after_trigger`). `for_tools` is the format as it
    reads the calls of one request's tools."""

    name: str
    markers: tuple[str, ...]

    @property
    def trigger(self) -> str | None: ...

    def for_tools(self, tools: list[dict[str, Any]]) -> CallFormat: ...

    def split(self, text: str, finished: bool,
              names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]: ...

    def marked_calls(self, answer: str) -> tuple[int, str] | None: ...

    def partial_calls(self, text: str) -> list[tuple[str, str, bool]]: ...

    def forced(self, tools: list[dict[str, Any]], several: bool = False) -> str: ...

    def after_trigger(self, tools: list[dict[str, Any]], several: bool) -> str: ...


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call text. `markers` open the tool-call part of an answer;
    `bare_start`, if set, is a first character that may open it without a marker (a
    template's marker token that decoding drops as special). `read_body` turns what
    follows the marker into the call objects, each with its JSON text (None unless all
    of it is calls); `forced_wrap` is the literal text around the calls of a constrained
    answer, each written as `{"name": ..., "<args_key>": ...}`, `separator` the text
    between two of them."""

    name: str
    markers: tuple[str, ...]
    args_key: str
    read_body: Callable[[str], list[Json] | None]
    forced_wrap: tuple[str, str]
    separator: str
    bare_start: str | None = None

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolFormat:
        """This format (JSON calls read alike whatever the tools)."""
        return self

    def call_start(self, text: str) -> int | None:
        """Where the tool-call part of `text` begins, if it has begun."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found)
        if self.bare_start is not None and text.lstrip().startswith(self.bare_start):
            return 0
        return None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` (no call begun) could be the start of
        a marker, and must not be streamed as content yet."""
        if self.bare_start is not None and not text.strip():
            return len(text)
        return max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) if `text` holds well-formed tool calls, else None."""
        start = self.call_start(text)
        if start is None:
            return None
        body = text[start:]
        for m in self.markers:
            if body.startswith(m):
                body = body[len(m):]
                break
        objects = self.read_body(body) or []
        calls = [c for o in objects if (c := _call(*o, self.args_key)) is not None]
        if not calls or len(calls) != len(objects):
            return None
        return text[:start].strip(), calls

    def split(self, text: str, finished: bool, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
        """A chat answer's content so far and, once `finished`, its tool calls, each of a
        function in `names` (None: any) or the answer has none. Content is stripped of
        surrounding blanks; while unfinished it stops where a call begins or might begin,
        so every earlier result is a prefix of the final content."""
        return split_answer(self, text, finished, names)

    def partial_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls of `text`, an answer of calls as `forced` writes them (`forced_wrap[0]`,
        calls joined by `separator`), as far as it has written them: (name, the arguments'
        JSON text so far, whether the arguments are complete) for each call whose name is
        written and whose arguments object has begun; [] before that, or if `text` is not
        such an answer. What a later `text` returns extends what an earlier one did, and a
        complete call's arguments are those `parse` gives."""
        calls: list[tuple[str, str, bool]] = []
        if not text.startswith(self.forced_wrap[0]):
            return calls
        at = len(self.forced_wrap[0])
        while (head := _FORCED_HEAD.match(text, at)) is not None and head["key"] == self.args_key:
            try:
                name = json.loads(head["name"])
            except ValueError:
                return calls
            start = head.end()
            end = _object_end(text, start)
            calls.append((name, text[start : len(text) if end is None else end], end is not None))
            close = None if end is None else _CALL_CLOSE.match(text, end)
            if close is None or not text.startswith(self.separator, close.end()):
                return calls
            at = close.end() + len(self.separator)
        return calls

    def marked_calls(self, answer: str) -> tuple[int, str] | None:
        """Where the calls of an unforced answer begin (its first `trigger`), and the text
        from there as `partial_calls` reads it; None before the trigger is written."""
        at = answer.find(self.trigger) if self.trigger else -1
        if at < 0:
            return None
        return at, answer[at:] if self.forced_wrap[0].startswith(self.trigger) else answer[at + len(self.trigger):]

    def forced(self, tools: list[dict[str, Any]], several: bool = False) -> str:
        """The regex of an answer that is exactly one call (`several`: one or more calls)
        of `tools` (OpenAI function tools), each call's arguments valid against its tool's
        parameter schema. Raises ValueError for a schema the constrained decoder cannot
        enforce."""
        return re.escape(self.forced_wrap[0]) + self._calls(tools, several)

    @property
    def trigger(self) -> str | None:
        """The marker that opens the calls of an unforced answer, if the format has one."""
        return self.markers[0] if self.markers else None

    def after_trigger(self, tools: list[dict[str, Any]], several: bool) -> str:
        """The regex of what follows `trigger` in an answer of calls: the rest of
        `forced`'s, so the answer is content, then the marker and well-formed calls of
        `tools`. Raises ValueError as `forced` does."""
        before = self.forced_wrap[0]
        lead = before[len(self.trigger):] if self.trigger and before.startswith(self.trigger) else before
        return re.escape(lead) + self._calls(tools, several)

    def _calls(self, tools: list[dict[str, Any]], several: bool) -> str:
        """The regex of the calls and what closes them, after `forced_wrap[0]`."""
        options = [schema_to_regex(json.dumps(self._call_schema(tool)), _WHITESPACE) for tool in tools]
        call = "(?:" + "|".join(options) + ")"
        more = f"(?:{re.escape(self.separator)}{call})*" if several else ""
        return call + more + re.escape(self.forced_wrap[1])

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        fn = tool["function"]
        return {"type": "object", "properties": {
            "name": {"const": fn["name"]},
            self.args_key: fn.get("parameters") or NO_PARAMETERS,
        }, "required": ["name", self.args_key]}


def split_answer(fmt: Any, text: str, finished: bool, names: frozenset[str] | None) -> tuple[str, list[ToolCall]]:
    """`CallFormat.split` for a format with `parse`, `call_start` and `held_back`."""
    if finished:
        parsed = fmt.parse(text)
        if parsed is None or (names is not None and any(c.name not in names for c in parsed[1])):
            return text.strip(), []
        return parsed
    start = fmt.call_start(text)
    return text[: len(text) - fmt.held_back(text) if start is None else start].strip(), []


Json = tuple[Any, str]  # a JSON value and the text it was read from
# the head of a forced call's JSON up to its arguments: a name, then the arguments' key
_FORCED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?P<key>\w+)"\s*:\s*(?=\{)')
_CALL_CLOSE = re.compile(r"\s*\}")  # after a call's arguments, the end of the call object


def _objects(body: str, separator: str) -> list[Json] | None:
    """The JSON values of `body`, each with its text, separated by `separator` (and
    blanks); None unless the whole body is such values."""
    values, i = [], 0
    while True:
        i = _skip_blanks(body, i)
        if i == len(body):
            return values or None
        if values:
            if not body.startswith(separator, i):
                return None
            i = _skip_blanks(body, i + len(separator))
        try:
            value, end = _DECODER.raw_decode(body, i)
        except (ValueError, RecursionError):
            return None
        if json_depth(value) > MAX_JSON_DEPTH:
            return None
        values.append((value, body[i:end]))
        i = end


def _skip_blanks(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


def _members(text: str) -> dict[str, str]:
    """The text of each member value of `text`, a JSON object known to parse (a key
    written twice: its last value, as `json.loads` reads it)."""
    out, i = {}, _skip_blanks(text, 1)
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        i = _skip_blanks(text, _skip_blanks(text, i) + 1)  # past ':'
        _, end = _DECODER.raw_decode(text, i)
        out[key], i = text[i:end], _skip_blanks(text, end)
        if text[i] == ",":
            i = _skip_blanks(text, i + 1)
    return out


def _items(text: str) -> list[str]:
    """The text of each item of `text`, a JSON array known to parse."""
    out, i = [], _skip_blanks(text, 1)
    while text[i] != "]":
        _, end = _DECODER.raw_decode(text, i)
        out.append(text[i:end])
        i = _skip_blanks(text, end)
        if text[i] == ",":
            i = _skip_blanks(text, i + 1)
    return out


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object opening at `text[start]` ends, or None while `text` holds
    only its beginning (the forced regex writes JSON, so nothing else fails to parse)."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except (ValueError, RecursionError):
        return None


def _hermes(body: str) -> list[Json] | None:  # body: after the first <tool_call>
    values = []
    for part in body.split("<tool_call>"):
        inner, sep, rest = part.partition("</tool_call>")
        value = _objects(inner, "")
        if not sep or value is None or len(value) != 1 or rest.strip():
            return None
        values.append(value[0])
    return values


def _mistral(body: str) -> list[Json] | None:
    value = _objects(body, "")
    if value is None or len(value) != 1 or not isinstance(value[0][0], list):
        return None
    items, text = value[0]
    return list(zip(items, _items(text), strict=True))


def _llama3(body: str) -> list[Json] | None:
    return _objects(body, ";")


def _call(obj: Any, text: str, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = args_key if args_key in obj else "arguments" if "arguments" in obj else None
    args, args_text = (obj[key], _members(text)[key]) if key is not None else ({}, "{}")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args_text, args = args, json_limits.loads(args, "tool call arguments")
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args_text)


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), "arguments", _hermes, ("<tool_call>\n", "\n</tool_call>"),
                         "\n</tool_call>\n<tool_call>\n"),
    "llama3": ToolFormat("llama3", ("<|python_tag|>",), "parameters", _llama3, ("", ""), "; ", bare_start="{"),
    # Mistral's marker is a special token, which decoding may drop: a forced call is the list alone
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), "arguments", _mistral, ("[", "]"), ", ", bare_start="["),
}


BARE_JSON = ToolFormat("json", (), "arguments", _llama3, ("", ""), "; ", bare_start="{")


@dataclass(frozen=True)
class ToolUse:
    """What one chat request's `tools` and `tool_choice` mean: the tools the template
    renders, the format its answer is parsed with (None: plain content), the regex its
    answer must match (None: unconstrained; it stands for the request's own constraint
    too), the functions its calls may name, whether the answer is a call (`forced`), and
    the `trigger` (None: none) after which `regex` holds, the answer being free before it
    (`SamplingParams.constraint_trigger`)."""

    rendered: list[dict[str, Any]] | None
    parse_format: CallFormat | None
    regex: str | None
    names: frozenset[str] = frozenset()
    forced: bool = False
    trigger: str | None = None

    def grammar_params(self, context_free: bool) -> dict[str, str | None]:
        """The sampling parameters that hold `regex`: as a Lark grammar when the server
        compiles those (`context_free`), so llguidance's lazy lexer compiles it in
        milliseconds (a token automaton of a tool set takes seconds on a large vocabulary,
        one of any JSON far longer); else the regex itself."""
        if self.regex is None:
            return {}
        if context_free and len(lark := lark_grammar(self.regex)) <= MAX_EBNF_CHARS:
            return {"ebnf": lark, "constraint_trigger": self.trigger}
        return {"regex": self.regex, "constraint_trigger": self.trigger}


def plan_tool_use(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                  fmt: CallFormat | None, constraint: Constraint | None, several: bool = True,
                  context_free: bool = False) -> ToolUse:
    """Check `tools` and `tool_choice` (OpenAI's meanings: "none" renders no tools and
    parses nothing; "auto", the default with tools, parses what the model writes;
    "required" or a named function constrains the answer to one call, in `fmt` or, without
    one, `BARE_JSON`). Beside OpenAI's `response_format`, "auto" means what it means on
    OpenAI: the answer either matches the format or is calls of the tools (`several`: one
    or more, else one), in `fmt`: one regex (for a format with free-form JSON,
    `json_object` among them, only where the server compiles it in llguidance,
    `context_free`; else the format constrains the whole answer). The
    constraint fields of SGLang and vLLM (`regex`, `json_schema`, `guided_*`,
    `structured_outputs`) constrain the whole answer, as there. A forced call refuses any
    `constraint`. Raises ApiError. The plan's `parse_format` is `fmt` as it reads these
    tools' calls (`CallFormat.for_tools`)."""
    names = [_tool_name(t, i) for i, t in enumerate(tools or [])]
    choice = tool_choice if tool_choice is not None else ("auto" if names else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        wanted = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(wanted, str):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if wanted not in names:
            raise ApiError(400, f"tool_choice names {wanted!r}, which is not among the tools", "tool_choice")
        allowed = [t for t, n in zip(tools or [], names, strict=True) if n == wanted]
    elif choice in ("none", "auto", "required"):
        allowed = list(tools or [])
    else:
        raise ApiError(400, f'tool_choice must be "none", "auto", "required" or a function; got {choice!r}',
                       "tool_choice")
    if choice != "none" and not names:
        raise ApiError(400, "tool_choice needs tools", "tool_choice")
    if choice == "none":
        return ToolUse(None, None, None)
    fmt = None if fmt is None else fmt.for_tools(allowed)
    if choice == "auto":
        if constraint is None and fmt is not None:
            calls = _gated_calls(fmt, allowed, several, context_free)
            return ToolUse(tools, fmt, calls, frozenset(names), trigger=fmt.trigger if calls else None)
        if constraint is None or constraint.field != "response_format" or fmt is None:
            return ToolUse(tools, fmt, None, frozenset(names))  # the request's own constraint holds the answer
        answer = response_format_regex(constraint)
        if answer is not None:
            return ToolUse(tools, fmt, f"(?:{answer})|(?:{_calls_regex(fmt, allowed, several)})", frozenset(names))
        if context_free:  # free-form JSON: a regex llguidance compiles fast (`grammar_params`)
            union = f"(?:{response_format_regex(constraint, free_form=True)})|(?:{_calls_regex(fmt, allowed, several)})"
            return ToolUse(tools, fmt, union, frozenset(names))
        return ToolUse(tools, fmt, None, frozenset(names))  # the format holds the whole answer
    fmt = fmt or BARE_JSON
    if constraint is not None:
        raise ApiError(400, "a forced tool call cannot be combined with regex, json_schema or response_format",
                       "tool_choice")
    return ToolUse(tools, fmt, _calls_regex(fmt, allowed, False),
                   frozenset(_tool_name(t, i) for i, t in enumerate(allowed)), forced=True)


def _gated_calls(fmt: CallFormat, tools: list[dict[str, Any]], several: bool, context_free: bool) -> str | None:
    """The regex of what follows `fmt`'s trigger in an unforced answer of calls, or None
    when `fmt` has no trigger, or a tool's parameters cannot be enforced or admit free-form
    JSON without `context_free` (a regex of any JSON compiles slowly but in llguidance):
    then the calls are parsed unconstrained."""
    if fmt.trigger is None or (not context_free and any(
            admits_free_form(json.dumps(t["function"].get("parameters") or NO_PARAMETERS)) for t in tools)):
        return None
    try:
        return fmt.after_trigger(tools, several)
    except ValueError:
        return None


def _calls_regex(fmt: CallFormat, tools: list[dict[str, Any]], several: bool) -> str:
    try:
        return fmt.forced(tools, several)
    except ValueError as e:
        raise ApiError(400, f"cannot constrain a call to these tools: {e}", "tools") from None


def arguments_regex(tool: dict[str, Any]) -> str:
    """The regex of a call's arguments alone (a format that writes the function's name
    outside the JSON, harmony's): an object valid against `tool`'s parameter schema.
    Raises ApiError (400 naming `tools`) for a schema the constrained decoder cannot enforce."""
    try:
        return schema_to_regex(json.dumps(tool["function"].get("parameters") or NO_PARAMETERS), _WHITESPACE)
    except ValueError as e:
        raise ApiError(400, f"cannot constrain a call to these tools: {e}", "tools") from None


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                            f'"parameters": {{...}}}}}}', "tools")
    if not isinstance(fn.get("parameters", {}), dict):
        raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return fn["name"]
