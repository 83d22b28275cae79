"""Qwen3-Coder's XML-like tool calls (`qwen3_coder`): values read by the tools' schemas,
calls streamed as written adding up to the whole, and the regex of forced and gated
calls against the reader, by `re` and by both grammar backends on a real tokenizer."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sprig.runtime.constrained import GrammarSpec, GuidanceBackend, OutlinesBackend
from sprig.runtime.constrained.regex_text import lark_grammar
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.tool_calls import ToolCall, plan_tool_use
from sprig.runtime.server.tool_formats import TOOL_FORMATS
from sprig.runtime.server.xml_tool_calls import XmlToolFormat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "zip": {"type": "string"},
                                     "dry_run": {"type": "boolean"}, "options": {"type": "object"},
                                     "lines": {"type": "array", "items": {"type": "integer"}}},
    "required": ["path"]}}}
TOOLS = [WEATHER, TIME, EDIT]
FMT = XmlToolFormat().for_tools(TOOLS)
CODE = 'if a < b:\n    return "x</param"\n'


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WRITTEN = ("Let me look.\n" + call("get_weather", ("city", "Rome"), ("days", "3")) + "\n"
           + call("edit", ("path", CODE), ("zip", "94110"), ("dry_run", "true"), ("options", '{"a": [1]}'),
                  ("lines", "[1, 2]")))


def test_values_are_read_by_the_schema_and_arguments_are_json() -> None:
    content, calls = FMT.parse(WRITTEN)
    assert content == "Let me look."
    assert calls == [ToolCall("get_weather", '{"city": "Rome", "days": 3}'),
                     ToolCall("edit", json.dumps({"path": CODE, "zip": "94110", "dry_run": True,
                                                  "options": {"a": [1]}, "lines": [1, 2]}))]
    # without the tools' schemas a value is JSON where it parses: the zip code would be a number
    assert json.loads(XmlToolFormat().parse(WRITTEN)[1][1].arguments)["zip"] == 94110
    # a value of another type that is not JSON stays text rather than being lost
    assert FMT.parse(call("get_weather", ("city", "Rome"), ("days", "three")))[1][0].arguments == (
        '{"city": "Rome", "days": "three"}')
    assert FMT.parse(call("get_time"))[1] == [ToolCall("get_time", "{}")]


@pytest.mark.parametrize("text", [
    "no call at all",
    call("get_weather", ("city", "Rome")).replace("</parameter>", ""),
    call("get_weather", ("city", "Rome")).replace("</function>", ""),
    call("get_weather", ("city", "Rome")).replace("</tool_call>", ""),
    call("get_weather", ("city", "Rome")) + " and then some text",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>",  # hermes's JSON is not this format
    call("get_weather", ("city", "Rome")).replace("<parameter=city>\n", "city: "),
])
def test_anything_but_well_formed_calls_stays_content(text: str) -> None:
    assert FMT.parse(text) is None
    assert FMT.split(text, True) == (text.strip(), [])


def test_split_keeps_calls_of_the_request_functions_only() -> None:
    assert FMT.split(WRITTEN, True, frozenset({"get_weather"})) == (WRITTEN.strip(), [])
    assert [c.name for c in FMT.split(WRITTEN, True, frozenset({"get_weather", "edit"}))[1]] == ["get_weather", "edit"]
    # unfinished: content up to where a call begins or might begin
    assert FMT.split("Let me look.\n<tool_", False) == ("Let me look.", [])
    assert FMT.split(WRITTEN[:40], False) == ("Let me look.", [])


def test_calls_stream_as_written_and_add_up_to_the_whole() -> None:
    """Every prefix of an answer of calls: each call's arguments extend those of the
    prefix before, and complete ones equal what `parse` reads."""
    text = WRITTEN[WRITTEN.index("<tool_call>"):]
    _, whole = FMT.parse(text)
    before: list[tuple[str, str, bool]] = []
    for end in range(len(text) + 1):
        now = FMT.partial_calls(text[:end])
        assert len(now) >= len(before)
        for (name, args, done), (old_name, old_args, old_done) in zip(now, before, strict=False):
            assert name == old_name and args.startswith(old_args) and (done or not old_done)
        for (name, args, done), parsed in zip(now, whole, strict=False):
            assert name == parsed.name and (args == parsed.arguments if done else parsed.arguments.startswith(args))
        before = now
    assert [(n, a) for n, a, done in before if done] == [(c.name, c.arguments) for c in whole]
    assert FMT.partial_calls("<tool_call>\n<function=get_wea") == []
    assert FMT.partial_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo") == [
        ("get_weather", "{", False)]


def test_forced_calls_hold_to_the_schemas() -> None:
    plan = plan_tool_use(TOOLS, "required", FMT, None)
    assert plan.forced and plan.parse_format.parameters.keys() == {"get_weather", "get_time", "edit"}
    good = [call("get_weather", ("city", "Rome")), call("get_weather", ("city", "Paris"), ("days", "7")),
            call("get_time"), call("edit", ("path", CODE), ("zip", "02139"), ("lines", "[1, 2]")),
            call("edit", ("path", "a.py"), ("options", '{"k": "v"}'))]
    bad = [call("get_weather", ("city", "Oslo")), call("get_weather", ("days", "3")),
           call("get_weather", ("days", "3"), ("city", "Rome")),  # the schema's order
           call("get_weather", ("city", "Rome"), ("days", "9")), call("get_weather", ("city", "Rome"), ("days", "3.5")),
           call("edit", ("path", "a</parameter>b")), call("edit", ("path", "a.py"), ("dry_run", "yes")),
           call("get_price"), call("get_time") + "\n" + call("get_time")]
    for text in good:
        assert re.fullmatch(plan.regex, text), text
        _, [parsed] = FMT.parse(text)
        tool = next(t for t in TOOLS if t["function"]["name"] == parsed.name)
        jsonschema.validate(json.loads(parsed.arguments), tool["function"].get("parameters") or {})
    for text in bad:
        assert not re.fullmatch(plan.regex, text), text
    several = plan_tool_use(TOOLS, "auto", FMT, None, context_free=True)
    assert several.trigger == "<tool_call>" and not several.forced
    assert plan_tool_use(TOOLS, "auto", FMT, None).regex is None  # free-form JSON: only where llguidance compiles
    two = good[0] + "\n" + good[2]
    assert re.fullmatch(several.regex, two[len("<tool_call>"):])
    assert [c.name for c in FMT.split("Sure." + two, True, several.names)[1]] == ["get_weather", "get_time"]


def test_a_string_limit_raw_text_cannot_hold_is_a_400_for_a_forced_call() -> None:
    limited = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
    with pytest.raises(ApiError, match="pattern") as e:
        plan_tool_use([limited], "required", FMT, None)
    assert e.value.status == 400 and e.value.param == "tools"
    # in "auto" such calls are read unconstrained
    assert plan_tool_use([limited], "auto", FMT, None).regex is None


@pytest.mark.parametrize("backend_kind", ["outlines", "llguidance"])
def test_both_grammar_backends_write_calls_the_reader_reads(tokenizer, backend_kind: str) -> None:
    """The forced regex compiled for a real tokenizer: a call with code in a string value
    is taken token by token and ends there; one that breaks the schema is refused."""
    plan = plan_tool_use([WEATHER, EDIT], "required", TOOL_FORMATS["qwen3_coder"], None)
    stops = {tokenizer.eos_token_id}
    if backend_kind == "outlines":
        backend = OutlinesBackend.from_tokenizer(tokenizer)
        compiled = backend.prepare(backend.compile(GrammarSpec.regex(plan.regex)))
    else:
        backend = GuidanceBackend.from_tokenizer(tokenizer)
        compiled = backend.prepare(backend.compile(GrammarSpec("ebnf", lark_grammar(plan.regex))))

    def takes(text: str) -> bool:
        grammar = backend.matcher(compiled, stop_token_ids=stops)
        return grammar.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and grammar.is_terminated()

    assert takes(call("edit", ("path", CODE), ("dry_run", "false"))) and takes(call("get_weather", ("city", "Rome")))
    assert not takes(call("get_weather", ("city", "Oslo"))) and not takes(call("edit", ("path", "x</parameter>")))
