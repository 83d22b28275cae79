"""The real server driven by the official `openai` client: completions and chat, plain and
streamed (with usage), n, logprobs, stop, seeds, tool calls, the structured-output helpers,
and greedy text equal to the offline Engine's on the same checkpoint. After every test the scheduler is idle and intact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_helpers import Server
from transformers import AutoTokenizer

from sprig.runtime import Engine

openai = pytest.importorskip("openai")

PROMPT = "the quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "name a colour"}]
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def intact_after(server: Server) -> Iterator[None]:
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30.0, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> dict[str, dict]:
    """Greedy outputs of the offline Engine (float32, as the server runs the checkpoint)
    for the completion prompt and the rendered chat prompt."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    with Engine(tiny_llama, dtype="float32") as engine:
        return {"completion": engine.generate(PROMPT, params), "chat": engine.generate(input_ids=chat_ids,
                                                                                        sampling_params=params)}


def test_greedy_completion_equals_the_offline_engine(client, model: str, offline: dict) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    ref = offline["completion"]
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_chat_equals_the_offline_engine(client, model: str, offline: dict) -> None:
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    ref = offline["chat"]
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]


def test_completion_stream_with_usage(client, model: str) -> None:
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert "".join(c.choices[0].text for c in deltas) == full
    assert all(c.usage is None for c in deltas)
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10


def test_chat_stream_with_usage(client, model: str) -> None:
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert deltas[0].object == "chat.completion.chunk" and deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == full
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 10
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_n_choices(client, model: str) -> None:
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    sampled = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                             n=3, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert sampled.usage.completion_tokens == 3 * 8
    assert len({c.message.content for c in sampled.choices}) > 1  # n samples, not n copies


def test_completion_logprobs(client, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the top one
        assert top.get(token, logprob) == pytest.approx(logprob, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


def test_stop_strings(client, model: str) -> None:
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop
    out = client.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert out.text == full[: full.index(stop)] and out.finish_reason == "stop"
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                          stop=stop, extra_body={"ignore_eos": True}).choices[0]
    assert stop not in chat.message.content


def test_seed_reproduces_sampling(client, model: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first, again, other = sample(5), sample(5), sample(6)
    assert first == again
    assert first != other


def test_tool_calls(client, model: str) -> None:
    """A forced call comes back as the client's typed tool call, plain and streamed: the
    stream sends its name, then its arguments in pieces, which the client's own stream
    helper puts together into the same call."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "tools": [weather],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert {tc.index for tc in streamed} == {0} and len(streamed) > 2
    assert [tc.function.name for tc in streamed] == ["get_weather"] + [None] * (len(streamed) - 1)
    assert "".join(tc.function.arguments for tc in streamed) == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    [joined] = final.message.tool_calls
    assert (joined.function.name, joined.function.arguments) == ("get_weather", call.function.arguments)
    assert final.finish_reason == "tool_calls"


class Place(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


def test_structured_output_helpers(client, model: str) -> None:
    """The client's `parse` (a pydantic response_format, or a strict function tool) and
    its stream helper: each answer validates, and streamed equals whole (greedy)."""
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 200, "temperature": 0}
    message = client.chat.completions.parse(**kw, response_format=Place).choices[0].message
    with client.chat.completions.stream(**kw, response_format=Place) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert isinstance(message.parsed, Place) and streamed.parsed == message.parsed
    tool = openai.pydantic_function_tool(Place)
    call = client.chat.completions.parse(**kw, tools=[tool], tool_choice="required").choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Place)
    with client.chat.completions.stream(**kw, tools=[tool], tool_choice="required") as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert len(pieces) > 2 and "".join(pieces) == call.function.arguments
    assert final.function.parsed_arguments == call.function.parsed_arguments
