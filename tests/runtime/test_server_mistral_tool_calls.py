"""Mistral's v11 tool calls on the real server, driven by the official `openai` client,
with a scripted checkpoint (tests/runtime/mistral_checkpoint.py) whose tokenizer has the
markers as special tokens and whose template writes `[TOOL_CALLS]NAME[ARGS]{...}`: the
server, started with `--tool-call-parser mistral` as a vLLM user would, reads v11 calls.
The model's own call (its markers special tokens) arrives as an OpenAI tool call, whole
and streamed (`parallel_tool_calls` false: one); a forced call (named, or "required") is a call valid against the tool's
schema, whole and streamed alike; no content shows marker text; and the call and its
result go back through the template as Mistral's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from mistral_checkpoint import ANSWER, MARKERS, SCRIPT_TEXT, build_mistral_checkpoint
from server_helpers import Server, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mistral_checkpoint(tmp_path_factory.mktemp("mistral"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with running_server(model, "--tool-call-parser", "mistral") as s:
        yield s


@pytest.fixture(autouse=True)
def intact_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


def chat(client: Any, messages: list[dict[str, Any]] = MESSAGES, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, **{"temperature": 0, "max_tokens": 60, **kw})


def unmarked(text: str | None) -> bool:
    return not any(m in (text or "") for m in (*MARKERS, "[", "]"))


def streamed(client: Any, **kw: Any) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat's content, its calls (name, arguments) from the deltas, and its
    finish reason; each call's id and name come once, first."""
    deltas = [c.choices[0] for c in chat(client, stream=True, **kw) if c.choices]
    assert all(unmarked(d.delta.content) for d in deltas), [d.delta.content for d in deltas]
    pieces = [p for d in deltas for p in d.delta.tool_calls or ()]
    calls = []
    for i in sorted({p.index for p in pieces}):
        mine = [p for p in pieces if p.index == i]
        assert mine[0].id and [p.id for p in mine if p.id] == [mine[0].id]
        assert [p.function.name for p in mine if p.function.name] == [mine[0].function.name]
        calls.append((mine[0].function.name, "".join(p.function.arguments or "" for p in mine)))
    return "".join(d.delta.content or "" for d in deltas), calls, deltas[-1].finish_reason


def test_the_script_is_what_transformers_generates(model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompt = tok.apply_chat_template(MESSAGES, tools=[WEATHER], tokenize=False)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    assert out[-1] == tok.eos_token_id and tok.decode(out[:-1], skip_special_tokens=False) == SCRIPT_TEXT
    assert tok.decode(out[:-1], skip_special_tokens=True) != SCRIPT_TEXT  # the markers are special


def test_the_models_own_call_is_a_tool_call(client: Any) -> None:
    """tool_choice auto: the model writes content, then the special `[TOOL_CALLS]` (the
    trigger); the call after it is constrained to the tools (the model's special `[ARGS]`
    is refused there, spelt as text), whole and streamed alike. With parallel_tool_calls
    false the grammar ends after one call (the scripted model, pushed off its script
    there, would write calls until max_tokens)."""
    one = {"tools": [WEATHER, TIME], "parallel_tool_calls": False}
    choice = chat(client, **one).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    content, calls, finish = streamed(client, **one)
    assert (content, calls, finish) == ("Sure.", [("get_weather", call.function.arguments)], "tool_calls")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_matches_the_schema_whole_and_streamed(client: Any, choice: Any) -> None:
    out = chat(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    [call] = out.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish = streamed(client, tools=[WEATHER, TIME], tool_choice=choice)
    assert (content, calls, finish) == ("", [(call.function.name, call.function.arguments)], "tool_calls")


def test_the_call_and_its_result_go_back_through_the_template(client: Any, model: Path) -> None:
    first = chat(client, tools=[WEATHER], parallel_tool_calls=False).choices[0].message
    [call] = first.tool_calls
    turn = [*MESSAGES, {"role": "assistant", "content": first.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                        "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    out = chat(client, turn, tools=[WEATHER])
    assert out.choices[0].message.content == ANSWER.strip() and not out.choices[0].message.tool_calls
    tok = AutoTokenizer.from_pretrained(model)
    hf_turn = [*turn[:1], {**turn[1], "tool_calls": [{**turn[1]["tool_calls"][0], "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, turn[2]]
    rendered = tok.apply_chat_template(hf_turn, tools=[WEATHER], tokenize=False)
    written = json.dumps(json.loads(call.function.arguments))
    assert f"Sure.[TOOL_CALLS]get_weather[ARGS]{written}</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]" in rendered
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
