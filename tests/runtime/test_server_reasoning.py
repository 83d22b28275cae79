"""`--reasoning-parser` on the real server, with a scripted thinking model that writes
`<think> alpha beta</think> gamma` (tests/runtime/scripted_checkpoint.py): the reasoning
arrives as `reasoning_content` (streamed first, content only after it), and constraints
(response_format, forced tool calls, vLLM's fields) apply to the answer after `</think>`.
Each would fail if the constraint applied from the first token: the model could not
think at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from scripted_checkpoint import ANSWER, OPEN_THINK_TEMPLATE, REASONING, build_thinking_checkpoint
from server_helpers import Server, running_server
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "where is it sunny?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def qwen3(model: Path) -> Iterator[Server]:
    with running_server(model, "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def r1(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("r1") / "open_think.jinja"
    template.write_text(OPEN_THINK_TEMPLATE)
    with running_server(model, "--reasoning-parser", "deepseek-r1", "--chat-template", str(template)) as s:
        yield s


@pytest.fixture(scope="module")
def budgeted(model: Path) -> Iterator[Server]:
    with running_server(model, "--reasoning-parser", "qwen3", "--thinking-budget", "1") as s:
        yield s


def chat(server: Server, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def deltas(server: Server, **body) -> list[dict]:
    events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0,
                                                    "stream": True, **body})
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1]]


@pytest.mark.parametrize("which", ["qwen3", "r1"])
def test_reasoning_is_split_from_the_answer(request: pytest.FixtureRequest, which: str) -> None:
    server = request.getfixturevalue(which)
    choice = chat(server)
    assert choice["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    assert choice["finish_reason"] == "stop"
    unsplit = chat(server, separate_reasoning=False)["message"]
    assert "reasoning_content" not in unsplit and REASONING in unsplit["content"] and "</think>" in unsplit["content"]
    server.wait_idle()


def test_streamed_reasoning_comes_first_and_content_only_after_it(qwen3: Server) -> None:
    stream = deltas(qwen3)
    reasoning = [d["delta"]["reasoning_content"] for d in stream if d["delta"].get("reasoning_content")]
    content = [(i, d["delta"]["content"]) for i, d in enumerate(stream) if d["delta"].get("content")]
    assert "".join(reasoning) == REASONING and "".join(c for _, c in content) == ANSWER
    last_reasoning = max(i for i, d in enumerate(stream) if d["delta"].get("reasoning_content"))
    assert all(i >= last_reasoning for i, _ in content)
    assert stream[-1]["finish_reason"] == "stop"
    qwen3.wait_idle()


@pytest.mark.parametrize("which", ["qwen3", "r1"])
@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}},
    {"guided_json": SCHEMA},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_constraints_apply_after_the_reasoning(request: pytest.FixtureRequest, which: str, body: dict) -> None:
    server = request.getfixturevalue(which)
    message = chat(server, **body)["message"]
    assert message["reasoning_content"] == REASONING
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    server.wait_idle()


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_tool_calls_after_the_reasoning(qwen3: Server, tool_choice) -> None:
    choice = chat(qwen3, tools=[WEATHER], tool_choice=tool_choice)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == REASONING
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    stream = deltas(qwen3, tools=[WEATHER], tool_choice=tool_choice)
    assert "".join(d["delta"].get("reasoning_content", "") for d in stream) == REASONING
    assert not any(d["delta"].get("content") for d in stream)
    pieces = [c for d in stream for c in d["delta"].get("tool_calls", [])]  # streamed as written, after the reasoning
    assert stream[-1]["finish_reason"] == "tool_calls" and pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    first_call = next(i for i, d in enumerate(stream) if "tool_calls" in d["delta"])
    assert not any(d["delta"].get("reasoning_content") for d in stream[first_call:])
    qwen3.wait_idle()


def test_a_prompt_that_closes_the_think_block_is_constrained_at_once(qwen3: Server) -> None:
    message = chat(qwen3, chat_template_kwargs={"enable_thinking": False}, guided_json=SCHEMA)["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert chat(qwen3, chat_template_kwargs={"enable_thinking": False})["message"]["content"].startswith("<think>")
    qwen3.wait_idle()


@pytest.mark.parametrize("which", ["qwen3", "r1"])
def test_usage_counts_the_reasoning_tokens(request: pytest.FixtureRequest, which: str, model: Path,
                                           server: Server) -> None:
    """`completion_tokens_details.reasoning_tokens`, as SGLang and vLLM report it: the
    tokens of `reasoning_content`, summed over the choices, whole and streamed, and the same
    in the Responses API's `output_tokens_details`; absent where nothing is split off."""
    thinking = request.getfixturevalue(which)
    want = len(AutoTokenizer.from_pretrained(model).encode(REASONING, add_special_tokens=False))
    body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 0}
    one = thinking.post("/v1/chat/completions", body).json()["usage"]
    assert one["completion_tokens_details"] == {"reasoning_tokens": want} and one["completion_tokens"] > want
    two = thinking.post("/v1/chat/completions", body | {"n": 2}).json()["usage"]
    assert two["completion_tokens_details"] == {"reasoning_tokens": 2 * want}
    events = thinking.stream("/v1/chat/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    streamed = events[-2]["usage"]
    assert (streamed["completion_tokens"], streamed["completion_tokens_details"]) == (one["completion_tokens"],
                                                                                     one["completion_tokens_details"])
    unsplit = thinking.post("/v1/chat/completions", body | {"separate_reasoning": False}).json()["usage"]
    assert "completion_tokens_details" not in unsplit
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=thinking.url + "/v1", api_key="unused", max_retries=0) as client:
        responses = {"model": "m", "input": MESSAGES[0]["content"], "max_output_tokens": 200, "temperature": 0}
        whole = client.responses.create(**responses).usage
        [done] = [e.response.usage for e in client.responses.create(**responses, stream=True)
                  if e.type == "response.completed"]
    assert whole.output_tokens_details.reasoning_tokens == done.output_tokens_details.reasoning_tokens == want
    assert whole.output_tokens == done.output_tokens
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=thinking.url + "/v1", api_key="unused", model="m", temperature=0)
    assert llm.invoke(MESSAGES[0]["content"]).usage_metadata["output_token_details"]["reasoning"] == want
    assert "completion_tokens_details" not in server.post("/v1/chat/completions", body).json()["usage"]
    thinking.wait_idle()


# ---------------------------------------------------------------- thinking budgets
# The script thinks " alpha beta"; a budget of one token closes the reasoning after " alpha".


@pytest.mark.parametrize("which", ["qwen3", "r1"])
@pytest.mark.parametrize("field", ["thinking_budget", "thinking_token_budget"])
def test_a_thinking_budget_closes_the_reasoning(request: pytest.FixtureRequest, which: str, field: str,
                                               model: Path) -> None:
    server = request.getfixturevalue(which)
    choice = chat(server, **{field: 1})
    assert choice["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": "alpha"}
    assert choice["finish_reason"] == "stop"
    closed = chat(server, **{field: 0})["message"]
    assert not closed["reasoning_content"] and closed["content"] == ANSWER  # `<think></think> gamma`
    assert chat(server, **{field: 2})["message"]["reasoning_content"] == REASONING  # the script ends within it
    stream = deltas(server, **{field: 1})
    assert "".join(d["delta"].get("reasoning_content") or "" for d in stream) == "alpha"
    assert "".join(d["delta"].get("content") or "" for d in stream) == ANSWER
    usage = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0,
                                                 field: 1}).json()["usage"]
    alpha = AutoTokenizer.from_pretrained(model).encode("alpha", add_special_tokens=False)  # as reasoning_content
    assert usage["completion_tokens_details"] == {"reasoning_tokens": len(alpha)}
    server.wait_idle()


def test_a_budget_holds_the_reasoning_and_the_schema_the_answer(qwen3: Server) -> None:
    message = chat(qwen3, thinking_budget=1, response_format={
        "type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}})["message"]
    assert message["reasoning_content"] == "alpha"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    qwen3.wait_idle()


def test_a_budget_changes_nothing_where_the_prompt_closed_the_reasoning(qwen3: Server) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert chat(qwen3, thinking_budget=0, **off)["message"] == chat(qwen3, **off)["message"]
    qwen3.wait_idle()


def test_completions_generate_responses_and_messages_take_the_budget(qwen3: Server, model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    greedy = {"max_tokens": 200, "temperature": 0}
    text = qwen3.post("/v1/completions", {"prompt": prompt, "thinking_token_budget": 1, **greedy}).json()
    assert text["choices"][0]["text"] == f"<think> alpha</think> {ANSWER}"
    ids = tok.encode(prompt, add_special_tokens=False)
    out = qwen3.generate({"input_ids": [ids, ids], "sampling_params": [
        {"max_new_tokens": 200, "temperature": 0, "thinking_budget": 1},
        {"max_new_tokens": 200, "temperature": 0}]})
    assert [o["text"] for o in out] == [f"<think> alpha</think> {ANSWER}", f"<think> {REASONING}</think> {ANSWER}"]
    [one] = [qwen3.generate({"text": prompt, "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                                                   "thinking_budget": 0}})]
    assert one["text"] == f"<think></think> {ANSWER}"
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=qwen3.url + "/v1", api_key="unused", max_retries=0) as client:
        response = client.responses.create(model="m", input=MESSAGES[0]["content"], max_output_tokens=200,
                                           temperature=0, extra_body={"thinking_budget": 1})
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert [c.text for c in reasoning[0].content] == ["alpha"] and response.output_text == ANSWER
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=qwen3.url, api_key="unused", max_retries=0, timeout=60) as client:
        message = client.messages.create(model="m", max_tokens=200, messages=MESSAGES,
                                         thinking={"type": "enabled", "budget_tokens": 1})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "alpha"), ("text", ANSWER)]
    qwen3.wait_idle()


def test_a_budget_is_refused_where_it_cannot_be_held(qwen3: Server, server: Server) -> None:
    """A server without a reasoning parser has no end marker to write; a budget there is
    a 400 naming the field, as are a negative budget and two different ones."""
    body = {"messages": MESSAGES, "max_tokens": 8}
    for field in ("thinking_budget", "thinking_token_budget"):
        r = server.post("/v1/chat/completions", body | {field: 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "--reasoning-parser" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"prompt": "hi", "thinking_budget": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget", r.text
    r = server.post("/generate", {"text": "hi", "sampling_params": {"thinking_budget": 4}})
    assert r.status_code == 400 and "thinking_budget" in r.json()["error"]["message"], r.text
    r = server.post("/generate", {"text": "hi", "sampling_params": {"thinking_budget": 4, "reasoning_end": "."}})
    assert r.status_code == 200, r.text  # markers of the client's own are enforced anywhere
    r = qwen3.post("/v1/chat/completions", body | {"thinking_budget": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget", r.text
    r = qwen3.post("/v1/chat/completions", body | {"thinking_budget": 3, "thinking_token_budget": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    # a prompt of ids outside the vocabulary is refused before it is decoded to find where it starts
    r = qwen3.post("/v1/completions", {"prompt": [5, -3, 10**9], "thinking_budget": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = qwen3.post("/generate", {"input_ids": [5, -3], "sampling_params": {"thinking_budget": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text
    server.wait_idle()
    qwen3.wait_idle()


def test_the_servers_budget_holds_requests_that_give_none(budgeted: Server, model: Path) -> None:
    """`--thinking-budget`: chat, Responses and Messages requests without a budget of their
    own get the server's; a request's own wins; raw prompts (`/v1/completions`) are not
    held."""
    assert chat(budgeted)["message"]["reasoning_content"] == "alpha"
    assert chat(budgeted, thinking_token_budget=5)["message"]["reasoning_content"] == REASONING
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=budgeted.url, api_key="unused", max_retries=0, timeout=60) as client:
        message = client.messages.create(model="m", max_tokens=200, messages=MESSAGES)
    assert [getattr(b, "thinking", None) for b in message.content if b.type == "thinking"] == ["alpha"]
    prompt = AutoTokenizer.from_pretrained(model).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                       tokenize=False)
    raw = budgeted.post("/v1/completions", {"prompt": prompt, "max_tokens": 200, "temperature": 0}).json()
    assert raw["choices"][0]["text"] == f"<think> {REASONING}</think> {ANSWER}"
    budgeted.wait_idle()
