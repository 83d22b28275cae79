"""Tool-call formats: parsing answers into OpenAI tool calls, streaming splits, the regex of
a forced call (checked against the tool's schema), format detection and `tool_choice`."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from sprig.runtime.server.config import (
    HARMONY,
    TOOL_CALL_PARSER_ALIASES,
    TOOL_CALL_PARSERS,
    ServerConfig,
)
from sprig.runtime.server.constraints import Constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.request_builder import _call_for_template
from sprig.runtime.server.tool_calls import BARE_JSON, FORMATS, ToolCall, ToolUse, plan_tool_use
from sprig.runtime.server.tool_formats import TOOL_FORMATS, detect_format, resolve_format
from sprig.runtime.tiny_checkpoint import CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FORCEABLE = {**FORMATS, "json": BARE_JSON}  # every format a forced call is written in


def calls(*pairs: tuple[str, dict]) -> list[ToolCall]:
    return [ToolCall(name, json.dumps(args)) for name, args in pairs]


@pytest.mark.parametrize("fmt,text,expected", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     ("Let me look.", calls(("get_weather", {"city": "Rome"})))),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '"{\\"x\\": 1}"}</tool_call>', ("", calls(("a", {}), ("b", {"x": 1})))),
    ("llama3", '{"name": "get_time", "parameters": {}}', ("", calls(("get_time", {})))),
    ("llama3", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
     ("", calls(("a", {"x": 1}), ("b", {})))),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": "é"}}]', ("", [ToolCall("a", '{"x": "é"}')])),
    ("mistral", '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', ("", calls(("a", {}), ("b", {})))),
])
def test_well_formed_calls_parse(fmt: str, text: str, expected: tuple[str, list[ToolCall]]) -> None:
    assert FORMATS[fmt].parse(text) == expected


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "no call here"),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}\n</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n'),  # never closed
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call> and then prose'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("llama3", 'The answer is {"name": "a", "parameters": {}}'),  # a call opens the answer or nothing
    ("llama3", '{"name": "a", "parameters": {}} trailing'),
    ("mistral", '[1, 2]'),
])
def test_anything_else_stays_content(fmt: str, text: str) -> None:
    assert FORMATS[fmt].parse(text) is None
    assert FORMATS[fmt].split(text, finished=True) == (text.strip(), [])


def test_streamed_content_never_shows_a_call_and_only_grows() -> None:
    fmt = FORMATS["hermes"]
    text = ' Sure, one moment.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    seen = [fmt.split(text[:i], finished=False)[0] for i in range(len(text) + 1)]
    assert all("<" not in s for s in seen)
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))
    final = fmt.split(text, finished=True)
    assert final == ("Sure, one moment.", calls(("get_time", {})))
    assert final[0].startswith(seen[-1])
    assert fmt.split("The sum is 4 <", finished=False)[0] == "The sum is 4"  # '<' may open a call
    llama = FORMATS["llama3"]
    assert llama.split('{"name": "get', finished=False)[0] == ""  # an answer opening with '{' is held
    assert llama.split("  ", finished=False)[0] == ""


@pytest.mark.parametrize("fmt", sorted(FORCEABLE))
def test_forced_regex_admits_only_valid_calls_of_the_allowed_tools(fmt: str) -> None:
    f = FORCEABLE[fmt]
    regex = f.forced([WEATHER, TIME])
    key = f.args_key
    good = [{"name": "get_weather", key: {"city": "Rome"}}, {"name": "get_weather", key: {"city": "Paris", "days": 3}},
            {"name": "get_time", key: {}}]
    bad = [{"name": "get_weather", key: {"city": "Oslo"}}, {"name": "get_weather", key: {}},
           {"name": "get_weather", key: {"city": "Rome", "days": 9}}, {"name": "other", key: {}}]
    wrap = {"hermes": "<tool_call>\n{}\n</tool_call>", "llama3": "{}", "mistral": "[{}]", "json": "{}"}[fmt]
    for obj in good:
        text = wrap.replace("{}", json.dumps(obj), 1) if fmt not in ("llama3", "json") else json.dumps(obj)
        assert re.fullmatch(regex, text), text
        content, parsed = f.split(text, finished=True)
        assert content == "" and [c.name for c in parsed] == [obj["name"]]
        if obj["name"] == "get_weather":
            jsonschema.validate(json.loads(parsed[0].arguments), WEATHER["function"]["parameters"])
    for obj in bad:
        text = wrap.replace("{}", json.dumps(obj), 1) if fmt not in ("llama3", "json") else json.dumps(obj)
        assert not re.fullmatch(regex, text), text
    only_time = f.forced([TIME])
    assert not re.fullmatch(only_time, wrap.replace("{}", json.dumps(good[0]), 1) if fmt not in ("llama3", "json")
                            else json.dumps(good[0]))


def test_detection_from_the_chat_template() -> None:
    assert detect_format(CHAT_TEMPLATE) is FORMATS["hermes"]  # the tiny checkpoints' template
    assert detect_format("{{ '[TOOL_CALLS] ' + calls | tojson }}") is FORMATS["mistral"]
    assert detect_format("{{- '<|python_tag|>' + tool_call }}") is FORMATS["llama3"]
    assert detect_format("{{ messages }}") is None and detect_format(None) is None
    coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n{{ value }}\n</parameter>"
    assert detect_format(coder) is TOOL_FORMATS["qwen3_coder"] and detect_format("<tool_call>") is FORMATS["hermes"]
    assert resolve_format("none", CHAT_TEMPLATE) is None
    assert resolve_format("llama3", CHAT_TEMPLATE) is FORMATS["llama3"]
    assert resolve_format("auto", CHAT_TEMPLATE) is FORMATS["hermes"]


def test_tool_choice_plans() -> None:
    hermes = FORMATS["hermes"]
    assert plan_tool_use(None, None, hermes, None) == ToolUse(None, None, None)
    both = frozenset({"get_weather", "get_time"})
    auto = plan_tool_use([WEATHER, TIME], None, hermes, None)  # content, or calls once the marker is written
    assert auto == ToolUse([WEATHER, TIME], hermes, hermes.after_trigger([WEATHER, TIME], True), both,
                           trigger="<tool_call>")
    assert plan_tool_use([WEATHER], "none", hermes, None) == ToolUse(None, None, None)
    assert plan_tool_use([WEATHER], "auto", None, None) == ToolUse([WEATHER], None, None,  # nothing to parse with
                                                                   frozenset({"get_weather"}))
    named = plan_tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, hermes, None)
    assert named.regex == hermes.forced([TIME]) and named.parse_format is hermes and named.forced
    assert named.names == frozenset({"get_time"})
    required = plan_tool_use([WEATHER, TIME], "required", hermes, None)
    assert required.regex == hermes.forced([WEATHER, TIME]) and required.names == both and required.forced
    # a template that teaches no format: auto stays plain text, a forced call is bare JSON
    assert plan_tool_use([WEATHER], "required", None, None) == ToolUse([WEATHER], BARE_JSON,
                                                                       BARE_JSON.forced([WEATHER]),
                                                                       frozenset({"get_weather"}), forced=True)
    assert BARE_JSON.split('{"name": "get_weather", "arguments": {"city": "Rome"}}', finished=True) == (
        "", calls(("get_weather", {"city": "Rome"})))


PLACE = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_auto_beside_response_format_answers_it_or_calls_the_tools(name: str) -> None:
    """OpenAI's meaning of tools beside response_format: the answer matches the format, or
    is calls of the tools (several, unless parallel_tool_calls is false); the language is
    exactly that union. SGLang's and vLLM's constraint fields keep constraining the whole
    answer."""
    fmt = FORMATS[name]
    plan = plan_tool_use([WEATHER, TIME], "auto", fmt, Constraint("response_format", "json_schema", PLACE))
    assert not plan.forced and plan.parse_format is fmt and plan.names == frozenset({"get_weather", "get_time"})
    one = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
           "llama3": '{"name": "get_time", "parameters": {}}',
           "mistral": '[{"name": "get_time", "arguments": {}}]'}[name]
    two = {"hermes": one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
           "llama3": one + '; {"name": "get_weather", "parameters": {"city": "Rome"}}',
           "mistral": one[:-1] + ', {"name": "get_weather", "arguments": {"city": "Rome"}}]'}[name]
    for text, matches in (('{"city": "Oslo"}', True), ('{"city":"Lima"}', True), (one, True), (two, True),
                          ('{"city": "Rome"}', False), ('{"city": "Oslo"}' + one, False),
                          ('{"name": "get_time", "arguments": {"x": 1}}', False)):
        assert (re.fullmatch(plan.regex, text) is not None) == matches, text
    single = plan_tool_use([WEATHER, TIME], "auto", fmt, Constraint("response_format", "json_schema", PLACE),
                           several=False).regex
    assert re.fullmatch(single, one) and not re.fullmatch(single, two)
    assert [c.name for c in fmt.split(two, True, plan.names)[1]] == ["get_time", "get_weather"]
    for field, key, value in (("regex", "regex", "Oslo"), ("guided_json", "json_schema", PLACE),
                              ("response_format", "json_schema", {"type": "object"})):  # free-form: see below
        assert plan_tool_use([WEATHER], "auto", fmt, Constraint(field, key, value)).regex is None


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_auto_beside_a_free_form_response_format_is_a_lark_union(name: str, tmp_path) -> None:
    """json_object (or a schema with free-form JSON) beside tools: the union's regex as a
    Lark grammar, which llguidance compiles at once; where the server cannot compile one,
    the format constrains the whole answer."""
    from transformers import AutoTokenizer

    from sprig.runtime.constrained import GrammarSpec, GuidanceBackend
    from sprig.runtime.constrained.regex_text import lark_grammar
    from sprig.runtime.tiny_checkpoint import build_tokenizer

    fmt = FORMATS[name]
    json_object = Constraint("response_format", "json_schema", {"type": "object"})
    plan = plan_tool_use([WEATHER, TIME], "auto", fmt, json_object, context_free=True)
    params = plan.grammar_params(context_free=True)
    assert params == {"ebnf": lark_grammar(plan.regex), "constraint_trigger": None} and not plan.forced
    assert plan_tool_use([WEATHER, TIME], "auto", fmt, json_object).regex is None
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    backend = GuidanceBackend.from_tokenizer(tok)
    compiled = backend.prepare(backend.compile(GrammarSpec("ebnf", params["ebnf"])))

    def matches(text: str) -> bool:
        grammar = backend.matcher(compiled, stop_token_ids={tok.eos_token_id})
        return grammar.accept_tokens(tok.encode(text, add_special_tokens=False)) and grammar.is_terminated()

    one = fmt.forced_wrap[0] + f'{{"name": "get_weather", "{fmt.args_key}": {{"city": "Rome"}}}}'
    two = one + fmt.separator + f'{{"name": "get_time", "{fmt.args_key}": {{}}}}'
    assert matches('{"any": ["json", 1, {"x": null}]}') and matches(one + fmt.forced_wrap[1])
    assert matches(two + fmt.forced_wrap[1])
    wrong_calls = [one.replace("get_weather", "get_price"), one.replace("Rome", "Oslo")] if fmt.forced_wrap[0] else []
    for bad in ('["a list"]', '{"a":  1}', *(c + fmt.forced_wrap[1] for c in wrong_calls)):  # (llama3's: objects)
        assert not matches(bad), bad
    single = plan_tool_use([WEATHER, TIME], "auto", fmt, json_object, several=False, context_free=True)
    assert plan_tool_use([WEATHER, TIME], "auto", fmt, json_object, context_free=True) != single


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_auto_calls_are_constrained_after_the_marker(name: str) -> None:
    """tool_choice auto: the answer is free until the format's marker, then well-formed
    calls of the request's tools: the marker followed by what `after_trigger` matches is
    exactly what `forced` matches after the marker (llama3's bare calls, with no marker,
    stay unconstrained)."""
    fmt = FORMATS[name]
    plan = plan_tool_use([WEATHER, TIME], "auto", fmt, None)
    assert plan.trigger == fmt.markers[0] and not plan.forced
    good = {"hermes": '\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                      '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
            "llama3": '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
            "mistral": '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
            }[name]
    assert re.fullmatch(plan.regex, good)
    content, parsed = fmt.split("Let me look." + plan.trigger + good, True, plan.names)
    assert content == "Let me look." and [c.name for c in parsed] == ["get_time", "get_weather"]
    for bad in (good.replace("get_time", "get_price"), good.replace('"Rome"', '"Oslo"'), good[:-2], good + " ok"):
        assert not re.fullmatch(plan.regex, bad), bad
    single = plan_tool_use([WEATHER, TIME], "auto", fmt, None, several=False).regex
    assert not re.fullmatch(single, good)
    # a tool without parameters takes none (OpenAI's meaning); free-form parameters are not constrained
    bare = {"type": "function", "function": {"name": "ping"}}
    assert plan_tool_use([bare], "auto", fmt, None).trigger == fmt.markers[0]
    free = {"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}}
    assert plan_tool_use([WEATHER, free], "auto", fmt, None) == ToolUse([WEATHER, free], fmt, None,
                                                                       frozenset({"get_weather", "log"}))
    assert plan_tool_use([WEATHER, free], "auto", fmt, None, context_free=True).trigger == fmt.markers[0]
    assert plan.grammar_params(context_free=False) == {"regex": plan.regex, "constraint_trigger": plan.trigger}
    assert plan.grammar_params(context_free=True)["ebnf"].startswith("start: /")
    assert plan_tool_use([WEATHER], "auto", fmt, Constraint("regex", "regex", "x")).regex is None  # the request's


SCHEMA = Constraint("response_format", "json_schema", PLACE)


@pytest.mark.parametrize("tools,choice,fmt,constraint,needle", [
    (None, "required", FORMATS["hermes"], None, "needs tools"),
    ([WEATHER], "sometimes", FORMATS["hermes"], None, "tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, FORMATS["hermes"], None, "not among"),
    ([WEATHER], {"type": "function"}, FORMATS["hermes"], None, "tool_choice must be"),
    ([WEATHER], "required", FORMATS["hermes"], SCHEMA, "cannot be combined"),
    ([{"type": "function", "function": {"parameters": {}}}], "auto", FORMATS["hermes"], None, r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto", FORMATS["hermes"], None,
     "parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], "required",
     FORMATS["hermes"], None, "cannot constrain"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], "auto",
     FORMATS["hermes"], SCHEMA, "cannot constrain"),
])
def test_bad_tool_requests_are_400(tools, choice, fmt, constraint: Constraint | None, needle: str) -> None:
    with pytest.raises(ApiError, match=needle) as e:
        plan_tool_use(tools, choice, fmt, constraint)
    assert e.value.status == 400


def test_the_server_setting_names_every_format() -> None:
    assert set(TOOL_CALL_PARSERS) == {"auto", "none", *TOOL_FORMATS, HARMONY}  # harmony's calls: server.harmony
    assert ServerConfig(tool_call_parser="llama3").tool_call_parser == "llama3"
    assert set(TOOL_CALL_PARSER_ALIASES.values()) <= set(TOOL_CALL_PARSERS)  # each alias names a format
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="xml")


@pytest.mark.parametrize("arguments,expected", [
    ('{"city": "Rome"}', {"city": "Rome"}),  # JSON text, as OpenAI sends it: an object
    ({"city": "Rome"}, {"city": "Rome"}),  # already an object
    ("not json", "not json"),  # left as sent
    ("[1, 2]", "[1, 2]"),  # JSON, but not an object
])
def test_assistant_calls_reach_the_template_with_object_arguments(arguments, expected) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    assert _call_for_template(call) == {**call, "function": {"name": "get_weather", "arguments": expected}}
    assert call["function"]["arguments"] == arguments  # the request's message is not changed
