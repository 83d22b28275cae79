"""Qwen3-Coder's XML tool calls ("qwen3_coder") on the real server, driven by the official
`openai` client, with a scripted checkpoint (tests/runtime/xml_tool_checkpoint.py) whose
chat template shows the call format: the server, started with no parser flag, picks
qwen3_coder from the template. The model's call arrives as an OpenAI tool call, whole and
streamed (id and name once `<function=...>` is written, then the arguments in pieces),
with its values converted by the tool's schema; a forced call (`required`, or named) is a
call of an allowed tool valid against its schema, sampled or greedy; with tool_choice
"none" the XML stays content; and an earlier call and its result go back through the
template in XML form."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from server_helpers import Server, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer
from xml_tool_checkpoint import ARGUMENTS, CONTENT, SCRIPT_TEXT, build_coder_checkpoint

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {}}}}
# get_weather where the model's script is wrong: its city ("Paris") and days (3) are refused
NARROW = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 2}},
    "required": ["city"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ARGS_TEXT = '{"city": "Paris", "days": 3}'
TOOL_RESULT = "sunny"


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_coder_checkpoint(tmp_path_factory.mktemp("coder"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with running_server(model) as s:  # no --tool-call-parser: "auto" finds qwen3_coder in the template
        yield s


@pytest.fixture(autouse=True)
def intact_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:  # the checkpoint's own test starts no server
        request.getfixturevalue("server").wait_idle()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


def chat(client: Any, messages: list[dict[str, Any]] = MESSAGES, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, **{"temperature": 0, "max_tokens": 80, **kw})


def no_markup(text: str | None) -> bool:
    return not any(m in (text or "") for m in ("<tool_call>", "<function", "<parameter", "</"))


def test_the_script_is_what_transformers_generates(model: Path) -> None:
    """Greedy, after the generation prompt of any conversation (tools or none, an earlier
    call and its result or none), transformers writes the script, then EOS."""
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    earlier = [*MESSAGES, {"role": "assistant", "content": CONTENT, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}]
    for messages, tools in ((MESSAGES, None), (MESSAGES, [WEATHER, TIME]), (earlier, [WEATHER])):
        prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)[0, ids.shape[1]:]
        assert out[-1] == tok.eos_token_id and tok.decode(out[:-1]) == SCRIPT_TEXT, tok.decode(out)
    rendered = tok.apply_chat_template(earlier, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert all(s in rendered for s in ("<tool_call>", "<function=", "<parameter="))  # what auto-detection reads
    assert f"<|assistant|>\n{SCRIPT_TEXT}<|end|>\n<|tool|>\n<tool_response>\n{TOOL_RESULT}\n</tool_response>" in rendered


def test_a_call_beside_text(client: Any) -> None:
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS_TEXT)
    assert json.loads(call.function.arguments) == ARGUMENTS  # "days" an int, "city" a string


def test_a_streamed_call_beside_text(client: Any) -> None:
    whole = chat(client, tools=[WEATHER]).choices[0].message.tool_calls[0].function.arguments
    choices = [c.choices[0] for c in chat(client, tools=[WEATHER], stream=True) if c.choices]
    deltas = [c.delta for c in choices]
    assert "".join(d.content or "" for d in deltas) == CONTENT
    assert all(no_markup(d.content) for d in deltas), [d.content for d in deltas]
    pieces = [p for d in deltas for p in d.tool_calls or ()]
    assert pieces and {p.index for p in pieces} == {0}
    assert pieces[0].id and pieces[0].function.name == "get_weather"  # the header first
    assert [p.id for p in pieces if p.id] == [pieces[0].id]
    assert [p.function.name for p in pieces if p.function and p.function.name] == ["get_weather"]
    arguments = [p.function.arguments for p in pieces if p.function and p.function.arguments]
    assert "".join(arguments) == whole == ARGS_TEXT
    # a piece ends where a parameter's </parameter> or the </function> is written (or the header
    # is: "{"), never inside a value; pieces of several tokens written together come as one
    ends = {"{", '{"city": "Paris"', '{"city": "Paris", "days": 3', ARGS_TEXT}
    assert all("".join(arguments[: i + 1]) in ends for i in range(len(arguments))), arguments
    assert choices[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize(("tool_choice", "name"), [("required", None), (named("get_time"), "get_time"),
                                                (named("get_weather"), "get_weather")])
def test_a_forced_call(client: Any, tool_choice: Any, name: str | None) -> None:
    """Where the grammar admits one continuation the server appends it (jump-forward), which
    leaves the model's script: what it writes next is noise, held to the schema."""
    choice = chat(client, tools=[WEATHER, TIME], tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == (name or call.function.name) and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if call.function.name == "get_time":
        assert call.function.arguments == "{}"


def test_a_forced_call_keeps_the_models_tokens(client: Any) -> None:
    """With logprobs there is no jump-forward: every token is the model's, and the grammar
    admits each of its script's tokens that a call of get_weather may hold (the second
    choice after the prompt is `<tool_call>`, then `\n<function=get_weather>\n` and on).
    Not so with "required" among two functions: llguidance forces the text both calls
    begin with (`\n<function=get_`) in its own tokenization, so the script's one token
    for the header is refused there (outlines-core would allow it); the call is then
    spelled in smaller tokens, still a valid call (`test_a_forced_call`)."""
    choice = chat(client, tools=[WEATHER, TIME], tool_choice=named("get_weather"), logprobs=True).choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[:3] == ["<tool_call>", "\n<function=get_weather>\n", "<parameter=city>"], tokens
    assert "".join(tokens) == SCRIPT_TEXT.removeprefix(CONTENT + "\n"), tokens
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS_TEXT)


def test_a_streamed_forced_call(client: Any) -> None:
    choices = [c.choices[0] for c in chat(client, tools=[WEATHER, TIME], tool_choice=named("get_time"), stream=True)
               if c.choices]
    assert not "".join(c.delta.content or "" for c in choices)
    pieces = [p for c in choices for p in c.delta.tool_calls or ()]
    assert [p.function.name for p in pieces if p.function and p.function.name] == ["get_time"]
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == "{}"
    assert choices[-1].finish_reason == "tool_calls"


def test_sampled_forced_calls_hold_to_the_schema(client: Any) -> None:
    """At temperature 1: where the script fits the schema it is kept (its margin is far
    above the rest); where it does not (NARROW: "Paris" and 3 are refused), the grammar
    makes the noise below it a valid call."""
    for tool in (WEATHER, NARROW):
        schema = tool["function"]["parameters"]
        for seed in range(3):
            choice = chat(client, tools=[tool, TIME], tool_choice=named("get_weather"), temperature=1.0, seed=seed,
                          max_tokens=160).choices[0]
            assert choice.finish_reason == "tool_calls", (tool, seed, choice)
            assert choice.message.content is None
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, schema)
            assert isinstance(arguments.get("days", 1), int)
            if tool is NARROW:
                assert arguments["city"] == "Rome", arguments


def test_no_calls_when_tool_choice_is_none(client: Any) -> None:
    for kw in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        choice = chat(client, **kw).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (SCRIPT_TEXT, None, "stop")
    streamed = [c.choices[0] for c in chat(client, tools=[WEATHER], tool_choice="none", stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in streamed) == SCRIPT_TEXT
    assert not any(c.delta.tool_calls for c in streamed) and streamed[-1].finish_reason == "stop"


def test_a_call_and_its_result_go_back_through_the_template(client: Any, server: Server, model: Path) -> None:
    first = chat(client, tools=[WEATHER]).choices[0]
    [call] = first.message.tool_calls
    history = [*MESSAGES, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    again = chat(client, history, tools=[WEATHER], max_tokens=1)
    assert again.choices[0].finish_reason == "length"
    r = server.post("/tokenize", {"messages": history, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert again.usage.prompt_tokens == len(tokens)
    r = server.post("/detokenize", {"tokens": tokens, "skip_special_tokens": False})  # <|end|> is special
    assert r.status_code == 200, r.text
    rendered = r.json()["text"]
    # the call in XML, its string raw and its integer as JSON: the arguments reached the template as a mapping
    assert f"<|assistant|>\n{SCRIPT_TEXT}<|end|>\n<|tool|>\n<tool_response>\n{TOOL_RESULT}\n</tool_response>" in rendered
    as_parsed = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
    tok = AutoTokenizer.from_pretrained(model)
    assert rendered == tok.apply_chat_template(as_parsed, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
