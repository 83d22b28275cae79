"""Magistral's reasoning on the real server, driven by the official `openai` client, with
a scripted checkpoint (tests/runtime/magistral_checkpoint.py) whose `[THINK]`, `[/THINK]`
and tool-call markers are special tokens: started with `--reasoning-parser mistral
--tool-call-parser mistral` as a vLLM user would, it splits the thinking from the answer
whole and streamed (no marker and no `</s>` ever shown), constrains only the answer, closes
the reasoning with `[/THINK]` once a thinking budget is spent, reads the v11 call written
after the reasoning, and, after the tool's result, reads an answer given at once. The
Responses and Messages routes show the same reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from magistral_checkpoint import REASONING, SCRIPT_TEXT, build_magistral_checkpoint
from mistral_checkpoint import ANSWER, ARGUMENTS, CONTENT, MARKERS
from server_helpers import Server, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
SHOWN = ["[THINK]", "[/THINK]", "</s>", *MARKERS]  # text no reasoning or content may hold


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_magistral_checkpoint(tmp_path_factory.mktemp("magistral"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with running_server(model, "--reasoning-parser", "mistral", "--tool-call-parser", "mistral") as s:
        yield s


@pytest.fixture(scope="module")
def budgeted(model: Path) -> Iterator[Server]:
    with running_server(model, "--reasoning-parser", "mistral", "--thinking-budget", "1") as s:
        yield s


@pytest.fixture(autouse=True)
def intact_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("server", "budgeted"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


def chat(client: Any, messages: list[dict[str, Any]] = MESSAGES, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, **{"temperature": 0, "max_tokens": 40, **kw})


def unmarked(*texts: str | None) -> bool:
    return not any(m in (t or "") for t in texts for m in SHOWN)


def streamed(client: Any, **kw: Any) -> tuple[str, str, list[tuple[str, str]], str]:
    """A streamed chat's reasoning, content, calls (name, arguments) and finish reason;
    every delta unmarked, and no content before the reasoning's last delta."""
    deltas = [c.choices[0] for c in chat(client, stream=True, **kw) if c.choices]
    reasoning = [getattr(d.delta, "reasoning_content", None) for d in deltas]
    assert all(unmarked(r, d.delta.content) for r, d in zip(reasoning, deltas, strict=True))
    thought = [i for i, r in enumerate(reasoning) if r]
    assert not any(d.delta.content or d.delta.tool_calls for d in deltas[: max(thought, default=0)])
    pieces = [p for d in deltas for p in d.delta.tool_calls or ()]
    calls = [(p.function.name, "".join(q.function.arguments or "" for q in pieces if q.index == p.index))
             for p in pieces if p.function.name]
    content = "".join(d.delta.content or "" for d in deltas)
    return "".join(r or "" for r in reasoning), content, calls, deltas[-1].finish_reason


def test_the_script_is_what_transformers_generates(model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompt = tok.apply_chat_template(MESSAGES, tools=[WEATHER], tokenize=False)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    assert out[-1] == tok.eos_token_id and tok.decode(out[:-1], skip_special_tokens=False) == SCRIPT_TEXT
    assert "[THINK]" not in tok.decode(out, skip_special_tokens=True)  # the markers are special


def test_the_reasoning_then_a_v11_call(client: Any) -> None:
    choice = chat(client, tools=[WEATHER]).choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls"
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT.strip())
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", json.loads(ARGUMENTS))
    assert streamed(client, tools=[WEATHER]) == (REASONING, CONTENT.strip(), [("get_weather", call.function.arguments)],
                                                 "tool_calls")


def test_without_tools_the_answer_is_content(client: Any, model: Path) -> None:
    """The calls' markers are read out as decoding that skips special tokens reads them;
    `separate_reasoning: false` leaves the reasoning in the content, its markers spelt
    (as qwen3's `<think>`), the stop token not."""
    want = CONTENT.strip() + "get_weather" + ARGUMENTS
    message = chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, want)
    assert streamed(client) == (REASONING, want, [], "stop")
    raw = chat(client, extra_body={"separate_reasoning": False}).choices[0].message
    assert getattr(raw, "reasoning_content", None) is None
    assert raw.content == "[THINK] alpha beta[/THINK]" + CONTENT + "get_weather" + ARGUMENTS
    want_tokens = AutoTokenizer.from_pretrained(model).encode(REASONING, add_special_tokens=False)
    assert chat(client).usage.completion_tokens_details.reasoning_tokens == len(want_tokens)


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}},
    {"tools": [WEATHER], "tool_choice": "required"},
])
def test_constraints_apply_only_after_the_reasoning(client: Any, body: dict[str, Any]) -> None:
    choice = chat(client, **body).choices[0]
    assert choice.message.reasoning_content == REASONING
    answer = choice.message.tool_calls[0].function.arguments if "tools" in body else choice.message.content
    jsonschema.validate(json.loads(answer), SCHEMA)
    reasoning, content, calls, _ = streamed(client, **body)
    assert reasoning == REASONING and (calls[0][1] if "tools" in body else content) == answer


def test_a_thinking_budget_closes_the_reasoning_with_the_end_marker(client: Any, model: Path) -> None:
    """The script thinks " alpha beta" (two tokens); a budget of one writes `[/THINK]`
    after " alpha" and the answer follows; of none, right after `[THINK]`."""
    full = chat(client, tools=[WEATHER])
    one = chat(client, tools=[WEATHER], extra_body={"thinking_budget": 1})
    assert (one.choices[0].message.reasoning_content, one.choices[0].message.content) == ("alpha", CONTENT.strip())
    assert one.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert one.usage.completion_tokens == full.usage.completion_tokens - 1  # " beta" not written
    alpha = AutoTokenizer.from_pretrained(model).encode("alpha", add_special_tokens=False)
    assert one.usage.completion_tokens_details.reasoning_tokens == len(alpha)
    closed = chat(client, tools=[WEATHER], extra_body={"thinking_token_budget": 0}).choices[0].message
    assert not closed.reasoning_content and closed.content == CONTENT.strip()
    assert streamed(client, tools=[WEATHER], extra_body={"thinking_budget": 1})[:2] == ("alpha", CONTENT.strip())
    held = chat(client, extra_body={"thinking_budget": 1}, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}).choices[0].message
    assert held.reasoning_content == "alpha"
    jsonschema.validate(json.loads(held.content), SCHEMA)


def test_after_the_tool_result_it_answers_at_once(client: Any) -> None:
    first = chat(client, tools=[WEATHER]).choices[0].message
    [call] = first.tool_calls
    turn = [*MESSAGES, {"role": "assistant", "content": first.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                        "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    choice = chat(client, turn, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert (choice.message.reasoning_content, choice.message.content) == (None, ANSWER.strip())
    assert streamed(client, messages=turn, tools=[WEATHER]) == ("", ANSWER.strip(), [], "stop")


def test_responses_and_messages_show_the_reasoning(client: Any, server: Server) -> None:
    out = client.responses.create(model="m", input=MESSAGES[0]["content"], tools=[
        {"type": "function", "name": "get_weather", "parameters": SCHEMA}], max_output_tokens=40, temperature=0)
    kinds = {item.type: item for item in out.output}
    assert kinds["reasoning"].content[0].text == REASONING and kinds["function_call"].name == "get_weather"
    assert kinds["message"].content[0].text == CONTENT.strip()
    r = server.post("/v1/messages", {"model": "m", "max_tokens": 40, "messages": MESSAGES,
                                     "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert blocks[0] == {"type": "thinking", "thinking": REASONING, "signature": ""}
    assert all(unmarked(b.get("text")) for b in blocks)


def test_the_servers_budget_holds_requests_that_give_none(budgeted: Server) -> None:
    with openai.OpenAI(base_url=budgeted.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        message = chat(c).choices[0].message
        assert message.reasoning_content == "alpha" and unmarked(message.content)
        assert chat(c, extra_body={"thinking_budget": 2}).choices[0].message.reasoning_content == REASONING
