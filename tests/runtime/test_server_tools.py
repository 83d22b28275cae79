"""Tool calling through /v1/chat/completions on the real server: the tiny checkpoints'
template writes the Hermes format, so the server parses it ("auto"). A forced call
(`tool_choice` named or "required") is checked against the tool's schema; a call the
model writes on its own is made here with a `regex` that spells it out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from server_helpers import Server
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "what is the weather in Rome ?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WRITTEN = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.fixture(autouse=True)
def intact_after(server: Server):
    yield
    server.wait_idle()


def chat(server: Server, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 160, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_tool_choice_forces_a_valid_call(server: Server, seed: int) -> None:
    out = chat(server, tools=[TIME, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               temperature=1.0, seed=seed)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_a_forced_call_streams_as_it_is_written(server: Server) -> None:
    """Name first, then the arguments in pieces that add up to the whole answer's; cut
    short by max_tokens inside the arguments, the call holds those written so far, both
    ways, and the finish reason is "length"."""
    forced = {"tools": [TIME, WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = chat(server, **forced)
    written = whole["usage"]["completion_tokens"]
    cut = next(out for n in range(written - 4, 0, -4)  # the first cut inside the arguments
               if (out := chat(server, **forced, max_tokens=n))["choices"][0]["finish_reason"] == "length")
    for out in (whole, cut):
        choice, max_tokens = out["choices"][0], out["usage"]["completion_tokens"]
        events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": max_tokens,
                                                         "temperature": 0, "stream": True, **forced})
        deltas = [c["choices"][0] for c in events[:-1]]
        pieces = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
        assert len(pieces) > 2 and not any(d["delta"].get("content") for d in deltas)
        arguments = "".join(p["function"]["arguments"] for p in pieces)
        [call] = choice["message"]["tool_calls"]
        assert arguments == call["function"]["arguments"] and choice["message"]["content"] is None
        assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    assert cut["choices"][0]["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(cut["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


def test_required_calls_one_of_the_tools(server: Server) -> None:
    names = set()
    for seed in range(4):
        out = chat(server, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed)
        [call] = out["choices"][0]["message"]["tool_calls"]
        names.add(call["function"]["name"])
        schema = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert names <= {"get_weather", "get_time"}


def test_auto_parses_a_call_the_model_writes(server: Server) -> None:
    out = chat(server, tools=[WEATHER], regex=re.escape(WRITTEN))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Rome"})


def test_auto_streams_the_content_then_the_call(server: Server) -> None:
    body = {"messages": MESSAGES, "max_tokens": 160, "temperature": 0, "tools": [WEATHER],
            "regex": re.escape(WRITTEN), "stream": True}
    events = server.stream("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    deltas = [c["choices"][0] for c in events[:-1]]
    content = [d["delta"]["content"] for d in deltas if d["delta"].get("content")]
    assert "".join(content) == "Sure." and not any("<" in c for c in content)
    with_calls = [d for d in deltas if "tool_calls" in d["delta"]]
    assert len(with_calls) == 1 and with_calls[0] is deltas[-1]
    assert with_calls[0]["finish_reason"] == "tool_calls"
    [call] = with_calls[0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}


def test_auto_leaves_a_call_of_another_function_as_content(server: Server) -> None:
    """A model may call a function it was not given (the demo model has called get_price
    when offered add): that is no call of the request's, so the answer stays content, whole
    and streamed."""
    out = chat(server, tools=[TIME], regex=re.escape(WRITTEN))
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": WRITTEN} and choice["finish_reason"] == "stop"
    events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 160, "temperature": 0,
                                                     "tools": [TIME], "regex": re.escape(WRITTEN), "stream": True})
    deltas = [c["choices"][0] for c in events[:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == WRITTEN
    assert not any("tool_calls" in d["delta"] for d in deltas) and deltas[-1]["finish_reason"] == "stop"


PLACE = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"]}


def test_auto_beside_response_format_answers_it_or_calls_a_tool(server: Server) -> None:
    """As on OpenAI: the answer is content in the format, or calls of the tools (the
    format does not shut the tools out), whole and streamed alike."""
    body = {"tools": [WEATHER, TIME], "temperature": 1.0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}}
    kinds = []
    for seed in range(8):
        choice = chat(server, **body, seed=seed)["choices"][0]
        message = choice["message"]
        if "tool_calls" in message:
            assert choice["finish_reason"] == "tool_calls" and message["content"] is None
            for call in message["tool_calls"]:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
                jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            kinds.append("calls")
        else:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(message["content"]), PLACE)
            kinds.append("answer")
        events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 160, "stream": True,
                                                         "seed": seed, **body})
        deltas = [c["choices"][0] for c in events[:-1]]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == (message["content"] or "")
        streamed = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
        assert [c["function"] for c in streamed] == [c["function"] for c in message.get("tool_calls", [])]
    assert set(kinds) == {"answer", "calls"}


def test_tool_choice_none_renders_no_tools_and_parses_nothing(server: Server) -> None:
    with_tools = chat(server, tools=[WEATHER], regex=re.escape(WRITTEN))
    none = chat(server, tools=[WEATHER], tool_choice="none", regex=re.escape(WRITTEN))
    choice = none["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": WRITTEN}
    assert choice["finish_reason"] == "stop"
    assert none["usage"]["prompt_tokens"] < with_tools["usage"]["prompt_tokens"]  # no tools in the prompt


def test_a_conversation_with_a_tool_result_renders_the_call(server: Server, tiny_llama: Path) -> None:
    first = chat(server, tools=[WEATHER], tool_choice="required")
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny, 21 C", "tool_call_id": call["id"]}]
    out = chat(server, messages=messages, tools=[WEATHER], max_tokens=4)
    # the template gets the arguments as an object (OpenAI sends them as JSON text)
    args = json.loads(call["function"]["arguments"])
    as_object = {**call, "function": {**call["function"], "arguments": args}}
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.apply_chat_template([*MESSAGES, {**messages[1], "tool_calls": [as_object]}, messages[2]],
                                     tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert out["usage"]["prompt_tokens"] == len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert json.dumps({"name": "get_weather", "arguments": args}) in prompt and "sunny, 21 C" in prompt


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among"),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "x"}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
])
def test_bad_tool_requests_get_400(server: Server, body: dict, param: str, needle: str) -> None:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_auto_beside_json_object_answers_json_or_calls_a_tool(server: Server) -> None:
    """A free-form format (json_object) beside tools: the union through a Lark grammar, so
    the tools can be called (the format used to hold the whole answer), whole and
    streamed alike."""
    body = {"tools": [WEATHER, TIME], "temperature": 1.0, "response_format": {"type": "json_object"}}
    kinds = []
    for seed in range(8):
        choice = chat(server, **body, seed=seed)["choices"][0]
        message = choice["message"]
        if "tool_calls" in message:
            for call in message["tool_calls"]:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
                jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            kinds.append("calls")
        else:
            assert isinstance(json.loads(message["content"]), dict), message
            kinds.append("answer")
        events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 160, "stream": True,
                                                         "seed": seed, **body})
        deltas = [c["choices"][0] for c in events[:-1]]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == (message["content"] or "")
    assert "calls" in kinds, kinds
