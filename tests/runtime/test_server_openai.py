"""The real server's OpenAI-compatible routes: completions and chat completions, plain and
streamed (with usage), n, echo, logprobs, stop, penalties, seeds, logit_bias; /v1/models;
errors in OpenAI's format."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_helpers import Server
from transformers import AutoTokenizer

from sprig.runtime.server.constraints import request_constraint
from sprig.runtime.server.openai_format import sampling_dict
from sprig.runtime.server.protocol import ChatCompletionRequest

PROMPT = "what is the capital of France ?"
MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(autouse=True)
def intact_after(server: Server):
    yield
    server.wait_idle()


def completion(server: Server, **body) -> dict:
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(server: Server, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_equals_generate_and_reports_usage(server: Server) -> None:
    native = server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    out = completion(server)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == native["text"]
    assert out["choices"][0]["finish_reason"] == native["meta_info"]["finish_reason"]["type"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == native["meta_info"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt ran just before


def test_completion_batch_with_n(server: Server) -> None:
    out = completion(server, prompt=[PROMPT, "one two"], n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    ids = completion(server, prompt=[[1, 50, 60], [1, 70]])
    assert len(ids["choices"]) == 2 and ids["usage"]["prompt_tokens"] == 5


def test_completion_echo_with_logprobs(server: Server) -> None:
    out = completion(server, echo=True, logprobs=2)
    choice, usage = out["choices"][0], out["usage"]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][0] is None and all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_completion_stream_with_usage(server: Server) -> None:
    full = completion(server, max_tokens=12, ignore_eos=True)
    events = server.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True, "stream": True,
                                               "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12


def test_chat_renders_the_template(server: Server, tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    native = server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    out = chat(server)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": native["text"]}
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_chat_stream_with_usage_and_logprobs(server: Server) -> None:
    full = chat(server, max_completion_tokens=10, ignore_eos=True)
    body = {"messages": MESSAGES, "max_completion_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    events = server.stream("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == full["choices"][0]["message"]["content"]
    tokens = [t for c in chunks[1:] for t in c["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 10 and all(len(t["top_logprobs"]) == 2 for t in tokens)
    assert last["usage"]["completion_tokens"] == 10 and last["choices"] == []


def test_chat_roles_and_tool_messages(server: Server) -> None:
    messages = [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "text", "text": "call the tool"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    out = chat(server, messages=messages, n=2, max_tokens=3)
    assert [c["index"] for c in out["choices"]] == [0, 1]


def test_sampling_options(server: Server) -> None:
    assert chat(server, max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 5
    biased = completion(server, logit_bias={"77": 100.0}, max_tokens=4)
    native = server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "logit_bias": {"77": 100.0},
                                                                 "temperature": 0}})
    assert native["output_ids"] == [77] * 4 and biased["choices"][0]["text"] == native["text"]
    seeded = [completion(server, temperature=1.0, seed=3, max_tokens=8)["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]
    completion(server, presence_penalty=1.5, frequency_penalty=-0.5, top_p=0.9, stop=["\n", "x"])
    assert chat(server, response_format={"type": "text"}, max_tokens=2)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "array"}}}, {"type": "array"}),
    ],
)
def test_response_format_becomes_json_schema(fmt: dict, expected: dict | None) -> None:
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "response_format": fmt})
    assert sampling_dict(req, 4, request_constraint(req)).get("json_schema") == expected


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_a_client_that_gives_up_aborts_its_request(server: Server, path: str, body: dict) -> None:
    server.wait_idle()
    server.post("/flush_cache")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + path, json={**body, "max_tokens": 900, "ignore_eos": True}, timeout=0.2)
    assert server.wait_idle(timeout=5.0)["kv_evictable"] < 900  # aborted, not run to the end


def test_models(server: Server, tiny_llama: Path) -> None:
    data = server.get("/v1/models").json()["data"]
    assert data[0]["id"] == tiny_llama.name and data[0]["object"] == "model" and data[0]["max_model_len"] == 1024
    assert str(tiny_llama.parent) not in server.get("/v1/models").text  # no server path in responses


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens", "greater than or equal"),
        ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n", "greater than or equal"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "sampling_params", "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix", "suffix"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
    ],
)
def test_errors_use_openai_format(server: Server, path: str, body: dict, param: str, needle: str) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param and needle in error["message"]
