"""One chat request on a harmony (gpt-oss) server: which servers read harmony, the
sampling parameters that keep its markers and hold a constraint to the final channel (a
call, with tool_choice "auto", may end the output before it), a forced call's header
written into the prompt or held by a grammar of the whole turn, and what cannot be forced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sprig.runtime.server.config import ServerConfig
from sprig.runtime.server.constraints import Constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.harmony import FINAL, speaks_harmony
from sprig.runtime.server.harmony_call import HarmonyServing, calls_grammar
from sprig.runtime.server.tool_calls import plan_tool_use
from sprig.runtime.tiny_checkpoint import CHAT_TEMPLATE

PROMPT = "<|start|>user<|message|>weather?<|end|><|start|>assistant"
GPT_OSS = (Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
JSON_OBJECT = Constraint("response_format", "json_schema", '{"type": "object"}')
SERVING = HarmonyServing(reasoning=True, calls=True)


def turn(tools=None, choice=None, constraint=None, prompt: str = PROMPT, serving: HarmonyServing = SERVING,
         context_free: bool = False):
    return serving.turn(prompt, plan_tool_use(tools, choice, None, constraint), constraint, True, context_free)


@pytest.mark.parametrize(("reasoning", "tools", "template", "expected"), [
    ("gpt-oss", "auto", CHAT_TEMPLATE, HarmonyServing(True, True)),
    ("gpt-oss", "none", None, HarmonyServing(True, False)),
    (None, "gpt-oss", None, HarmonyServing(False, True)),
    (None, "auto", GPT_OSS, HarmonyServing(False, True)),  # detected from the template
    (None, "auto", CHAT_TEMPLATE, None),
    ("qwen3", "auto", GPT_OSS, None),
    (None, "none", GPT_OSS, None),
])
def test_which_servers_read_harmony(reasoning, tools: str, template, expected) -> None:
    assert HarmonyServing.of(reasoning, tools, template) == expected
    assert speaks_harmony(GPT_OSS) and not speaks_harmony(CHAT_TEMPLATE) and not speaks_harmony(None)


def test_harmony_holds_reasoning_and_calls_alike() -> None:
    assert ServerConfig(reasoning_parser="gpt-oss", tool_call_parser="gpt-oss").reasoning_parser == "gpt-oss"
    for reasoning, tools in (("gpt-oss", "hermes"), ("qwen3", "gpt-oss")):
        with pytest.raises(ValueError, match="gpt-oss format holds both"):
            ServerConfig(reasoning_parser=reasoning, tool_call_parser=tools)


def test_every_request_keeps_the_markers() -> None:
    t = turn([WEATHER])
    assert t.prompt == PROMPT and t.sampling == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert t.reader.opened == "assistant" and t.reader.names == {"get_weather"} and t.reader.split_reasoning


def test_a_constraint_holds_the_final_channel() -> None:
    assert turn(constraint=JSON_OBJECT).sampling["reasoning_end"] == FINAL == "<|channel|>final<|message|>"
    inside = turn(constraint=JSON_OBJECT, prompt=PROMPT + "<|channel|>final<|message|>")
    assert "reasoning_end" not in inside.sampling  # the output is the final channel's text from its first token
    assert "reasoning_end" in turn(constraint=JSON_OBJECT, prompt=PROMPT + "<|channel|>analysis<|message|>").sampling


def test_a_call_may_end_the_output_before_the_final_channel_a_constraint_holds() -> None:
    """tool_choice "auto" beside a constraint: `<|call|>` is the gate's exit; with no
    calls read, no tools, or a prompt inside the final channel, there is none."""
    t = turn([WEATHER], "auto", JSON_OBJECT)
    assert (t.sampling["reasoning_end"], t.sampling["reasoning_exits"]) == (FINAL, ["<|call|>"])
    assert t.reader.names == {"get_weather"} and not t.tools.forced
    assert "reasoning_exits" not in turn(constraint=JSON_OBJECT).sampling
    assert "reasoning_exits" not in turn([WEATHER], "none", JSON_OBJECT).sampling
    assert "reasoning_exits" not in turn([WEATHER], "auto", JSON_OBJECT, serving=HarmonyServing(True, False)).sampling
    inside = turn([WEATHER], "auto", JSON_OBJECT, prompt=PROMPT + "<|channel|>final<|message|>").sampling
    assert "reasoning_end" not in inside and "reasoning_exits" not in inside


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_is_written_into_the_prompt_where_no_lark_grammar_compiles(choice) -> None:
    t = turn([WEATHER], choice)
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert t.prompt == PROMPT + header and t.reader.opened == "assistant" + header
    assert t.tools.forced and t.sampling["regex"] == t.tools.regex and "constraint_trigger" not in t.sampling
    assert re.fullmatch(t.tools.regex, '{"city": "Rome"}') and not re.fullmatch(t.tools.regex, '{"city": "Oslo"}')
    assert not re.fullmatch(t.tools.regex, '{"name": "get_weather", "arguments": {"city": "Rome"}}')


def test_a_forced_call_on_a_server_that_parses_no_calls_still_reads_it() -> None:
    t = turn([WEATHER], NAMED, serving=HarmonyServing(reasoning=True, calls=False))
    assert t.reader.names == {"get_weather"} and turn([WEATHER], serving=HarmonyServing(True, False)).reader.names == set()


@pytest.mark.parametrize(("tools", "choice", "expected"), [
    ([WEATHER, TIME], "required", ["get_weather", "get_time"]),
    ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ([WEATHER], NAMED, ["get_weather"]),
])
def test_a_forced_call_is_a_grammar_of_the_whole_turn_where_lark_compiles(tools, choice, expected) -> None:
    """The prompt is left as it is (the model may think first); the grammar names each
    allowed function with its special tokens and holds its arguments."""
    t = turn(tools, choice, context_free=True)
    assert t.prompt == PROMPT and t.reader.opened == "assistant" and t.tools.forced
    assert "regex" not in t.sampling and "constraint_trigger" not in t.sampling
    grammar = t.sampling["ebnf"]
    assert grammar.startswith("start: message* call\n") and "<|channel|> <|message|>" not in grammar
    assert [n for n in ("get_weather", "get_time") if f'"{n} " <|constrain|> "json" <|message|>' in grammar] == expected
    assert calls_grammar([WEATHER]).count("<|constrain|>") == 1 and '"Paris"|"Rome"' in calls_grammar([WEATHER])


def test_a_forced_call_whose_grammar_is_too_large_is_a_400_naming_tools() -> None:
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": WEATHER["function"]["parameters"]}}
            for i in range(800)]
    with pytest.raises(ApiError, match="characters") as e:
        turn(many, "required", context_free=True)
    assert e.value.status == 400 and e.value.param == "tools"


@pytest.mark.parametrize(("tools", "choice", "constraint", "prompt", "context_free", "says"), [
    ([WEATHER, TIME], "required", None, PROMPT, False, "one of several functions"),
    ([WEATHER], NAMED, None, PROMPT + "<|channel|>final<|message|>x", False, "generation prompt"),
    ([WEATHER], NAMED, None, PROMPT + "<|channel|>final<|message|>x", True, "generation prompt"),
])
def test_what_harmony_cannot_force_is_refused(tools, choice, constraint, prompt: str, context_free: bool,
                                              says: str) -> None:
    with pytest.raises(ApiError, match=says) as e:
        turn(tools, choice, constraint, prompt, context_free=context_free)
    assert e.value.status == 400 and e.value.param == "tool_choice"
