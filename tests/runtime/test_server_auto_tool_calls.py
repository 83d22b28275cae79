"""tool_choice "auto" on the demo model, which writes Hermes calls: the answer is free until
the model writes `<tool_call>`, then well-formed calls of the request's tools
(`constraint_trigger`), streamed as they are written. Unconstrained, the demo model at temperature 1 offered only `add`
writes the marker and no well-formed call of `add` (calls of `get_price` or `multiply`):
`benchmarks/bench_auto_tool_calls.py` counts both ways."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from server_helpers import Server

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
QUESTIONS = ["What is 14 plus 9?", "Add 3 and 4."]


@pytest.fixture(scope="module")
def demo(demo_server: Server) -> Iterator[Server]:
    yield demo_server
    demo_server.wait_idle()


def body(question: str, seed: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": question}], "tools": [ADD], "temperature": 1.0, "seed": seed,
            "max_tokens": 200, **extra}


def answer(demo: Server, question: str, seed: int, **extra) -> dict:
    r = demo.post("/v1/chat/completions", body(question, seed, **extra))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_sampled_calls_are_calls_of_the_offered_tools(demo: Server) -> None:
    for question in QUESTIONS:
        for seed in range(6):
            choice = answer(demo, question, seed)
            message = choice["message"]
            assert "<tool_call>" not in (message["content"] or ""), (question, seed, message)
            if message.get("tool_calls"):
                assert choice["finish_reason"] == "tool_calls"
                for call in message["tool_calls"]:
                    assert call["function"]["name"] == "add"
                    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
    demo.wait_idle()


def test_one_call_when_parallel_calls_are_off(demo: Server) -> None:
    for seed in range(4):
        message = answer(demo, QUESTIONS[0], seed, parallel_tool_calls=False)["message"]
        assert len(message.get("tool_calls") or []) <= 1 and "<tool_call>" not in (message["content"] or "")


def test_streamed_and_batched_answers_equal_each_alone(demo: Server) -> None:
    alone = [answer(demo, q, seed)["message"] for q in QUESTIONS for seed in (7, 8)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda qs: answer(demo, *qs)["message"], [(q, s) for q in QUESTIONS for s in (7, 8)]))
    strip = [{**m, "tool_calls": [c["function"] for c in m.get("tool_calls") or []]} for m in alone]
    assert [{**m, "tool_calls": [c["function"] for c in m.get("tool_calls") or []]} for m in together] == strip
    for (question, seed), message in zip([(q, s) for q in QUESTIONS for s in (7, 8)], strip, strict=True):
        events = demo.stream("/v1/chat/completions", {**body(question, seed), "stream": True})
        deltas = [c["choices"][0]["delta"] for c in events[:-1]]
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
        pieces = [c for d in deltas for c in d.get("tool_calls", [])]
        calls = [{"name": p["function"]["name"], "arguments": "".join(
            q["function"]["arguments"] for q in pieces if q["index"] == p["index"])} for p in pieces if "id" in p]
        assert calls == message["tool_calls"]
        assert len(pieces) > len(calls) or not calls  # calls after the marker stream as they are written
    demo.wait_idle()
