"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the real
server, driven by the official `anthropic` client, with two scripted checkpoints:

- the "thinking" model (tests/runtime/scripted_checkpoint.py), served with
  `--reasoning-parser qwen3` and an API key: greedy it writes `<think> alpha beta</think>
  gamma</s>`, which arrives as a thinking block ("alpha beta", signature "") and a text
  block ("gamma"), whole and streamed (the client's `messages.stream` helper builds the
  same message), cut by `max_tokens` or a stop sequence; `thinking: disabled` renders the
  template with `enable_thinking` false, whose prompt closes the think block, so the same
  script is then all text;
- the Qwen3-Coder XML model (tests/runtime/xml_tool_checkpoint.py), which writes
  "I will check." and a call of get_weather: a text block then a tool_use block (streamed
  as `input_json_delta` pieces), a forced call for `tool_choice` tool/any, none for
  `none`, and a call's tool_result going back through the template.

Errors on these routes are Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`), which the client raises as its own exception classes; the key arrives as
`x-api-key` (what the client sends) or `Authorization: Bearer`; count_tokens counts the
prompt `/v1/messages` answers with, which its usage splits as Anthropic's does: `input_tokens`
(not from the cache) + `cache_read_input_tokens` (served from the prefix cache) +
`cache_creation_input_tokens` (0)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from scripted_checkpoint import ANSWER, REASONING, build_thinking_checkpoint
from server_helpers import TIMEOUT, Server, running_server
from xml_tool_checkpoint import ARGUMENTS, CONTENT, SCRIPT_TEXT, build_coder_checkpoint

anthropic = pytest.importorskip("anthropic")

KEY = "sk-test"
MAX_BYTES = 65_536  # the thinking server's --max-request-bytes: a larger body is a 413
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "Get the weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}
TIME = {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
              "message_delta", "message_stop"}
MESSAGE_KEYS = {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
UNSPLIT = f"<think> {REASONING}</think> {ANSWER}"  # the script, when the prompt has closed the think block


# ---------------------------------------------------------------- servers and clients


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def coder_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_coder_checkpoint(tmp_path_factory.mktemp("coder"))


@pytest.fixture(scope="module")
def thinking(thinking_model: Path) -> Iterator[Server]:
    """The key comes in SPRIG_API_KEY (as --api-key would); the helper's own requests
    (server info, wait_idle) and `Server.post` send it as `Authorization: Bearer`."""
    with running_server(thinking_model, "--reasoning-parser", "qwen3", "--max-request-bytes", str(MAX_BYTES),
                        api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def coder(coder_model: Path) -> Iterator[Server]:
    with running_server(coder_model) as s:  # no --tool-call-parser: "auto" finds qwen3_coder in the template
        yield s


@pytest.fixture(autouse=True)
def intact_after(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("thinking", "coder"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


def model_name(server: Server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(thinking: Server) -> Iterator[Any]:
    """Sends the key as `x-api-key`, as it does to Anthropic."""
    with anthropic.Anthropic(base_url=thinking.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tools_client(coder: Server) -> Iterator[Any]:
    with anthropic.Anthropic(base_url=coder.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def thinking_name(thinking: Server) -> str:
    return model_name(thinking)


@pytest.fixture(scope="module")
def coder_name(coder: Server) -> str:
    return model_name(coder)


def sampling(kw: dict[str, Any]) -> dict[str, Any]:
    """max_tokens 40 and temperature 0 unless `kw` says otherwise. This client (2.x) has
    no temperature/top_p/top_k arguments: they go in `extra_body`, as the API still takes them."""
    extra = {"temperature": 0} | {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    return {"max_tokens": 40, **kw, "extra_body": extra | kw.get("extra_body", {})}


def create(client: Any, model: str, messages: list[dict[str, Any]] = HI, **kw: Any) -> Any:
    return client.messages.create(model=model, messages=messages, **sampling(kw))


def prompt_tokens(usage: Any) -> int:
    """The prompt's length from a usage: Anthropic's `input_tokens` leaves out the tokens
    read from (or written to) the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def count(client: Any, model: str, messages: list[dict[str, Any]] = HI, **kw: Any) -> int:
    return client.messages.count_tokens(model=model, messages=messages, **kw).input_tokens


def streamed(client: Any, model: str, messages: list[dict[str, Any]] = HI, **kw: Any) -> tuple[list[Any], Any]:
    """The raw events of `messages.stream` (the helper's own text/thinking/input_json
    events left out) and the message it builds from them."""
    with client.messages.stream(model=model, messages=messages, **sampling(kw)) as s:
        events = [e for e in s if e.type in RAW_EVENTS]
        return events, s.get_final_message()


def blocks(message: Any) -> list[tuple[Any, ...]]:
    """The content, ids left out: (type, text) / (type, thinking, signature) / (type, name, input)."""
    out: list[tuple[Any, ...]] = []
    for b in message.content:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        elif b.type == "tool_use":
            out.append(("tool_use", b.name, b.input))
        else:
            out.append((b.type,))
    return out


def shape(events: list[Any]) -> list[str]:
    """The event sequence, a run of deltas of one kind as one entry ("signature_delta"s,
    which must carry "", dropped: the thinking block's signature is empty)."""
    out: list[str] = []
    for e in events:
        if e.type == "content_block_start":
            label = f"start {e.content_block.type}"
        elif e.type == "content_block_delta":
            if e.delta.type == "signature_delta":
                assert e.delta.signature == "", e
                continue
            label = e.delta.type
        elif e.type == "content_block_stop":
            label = "stop"
        else:
            label = e.type
        if not (out and out[-1] == label and label.endswith("_delta")):
            out.append(label)
    return out


def block_indices_hold(events: list[Any]) -> None:
    """Block events carry the index of their block: 0, 1, ... in order, each started,
    delta'd and stopped before the next starts."""
    current = -1
    for e in events:
        if e.type == "content_block_start":
            assert e.index == current + 1, events
            current = e.index
        elif e.type in ("content_block_delta", "content_block_stop"):
            assert e.index == current, events


def deltas(events: list[Any], kind: str, field: str) -> str:
    return "".join(getattr(e.delta, field) for e in events if e.type == "content_block_delta" and e.delta.type == kind)


def sse(server: Server, body: dict[str, Any], **headers: str) -> list[tuple[str, Any]]:
    """(event name, data) of each SSE event of a streamed /v1/messages."""
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=TIMEOUT,
                      headers=server.headers | headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        lines = [line for line in r.iter_lines() if line]
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            assert name is None, lines
            name = line[len("event: "):]
        else:
            assert line.startswith("data: ") and name is not None, lines
            events.append((name, orjson.loads(line[len("data: "):])))
            name = None
    return events


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    """The body must be exactly Anthropic's error object; its message is returned."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def raised(exc: Any, kind: str) -> str:
    """The error type of an exception the client raised, and its message."""
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    return exc.body["error"]["message"]


# ---------------------------------------------------------------- the thinking model


def test_reasoning_and_answer(client: Any, thinking: Server, thinking_name: str) -> None:
    out = create(client, thinking_name, metadata={"user_id": "u-1"}, top_p=1.0, top_k=5)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant", out
    assert out.model == thinking_name
    assert blocks(out) == [("thinking", REASONING, ""), ("text", ANSWER)]
    assert (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    # the same prompt as the chat API's, the same tokens written
    chat = thinking.post("/v1/chat/completions", {"messages": HI, "max_tokens": 40, "temperature": 0}).json()["usage"]
    assert prompt_tokens(out.usage) == count(client, thinking_name) == chat["prompt_tokens"]
    assert out.usage.output_tokens == chat["completion_tokens"] > 0
    assert out.usage.cache_creation_input_tokens == 0
    again = create(client, thinking_name)  # the prompt is in the prefix cache now
    assert prompt_tokens(again.usage) == prompt_tokens(out.usage)
    assert again.usage.cache_read_input_tokens == chat["prompt_tokens"] - again.usage.input_tokens > 0
    assert again.usage.input_tokens >= 1  # the last prompt token is always computed
    assert blocks(again) == blocks(out) and again.id != out.id


def test_the_raw_answer_is_anthropics_shape(thinking: Server, thinking_name: str) -> None:
    r = thinking.post("/v1/messages", {"model": thinking_name, "messages": HI, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == MESSAGE_KEYS, body
    assert (body["type"], body["role"], body["stop_reason"], body["stop_sequence"]) == (
        "message", "assistant", "end_turn", None)
    thought, text = body["content"]
    assert thought == {"type": "thinking", "thinking": REASONING, "signature": ""}
    assert (text["type"], text["text"]) == ("text", ANSWER)
    assert {"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"} <= set(
        body["usage"]), body["usage"]
    r = thinking.post("/v1/messages/count_tokens", {"model": thinking_name, "messages": HI})
    usage = body["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert r.status_code == 200 and r.json() == {"input_tokens": total}, r.text
    assert usage["cache_creation_input_tokens"] == 0


def test_a_streamed_answer(client: Any, thinking_name: str) -> None:
    whole = create(client, thinking_name)
    events, final = streamed(client, thinking_name)
    assert shape(events) == ["message_start", "start thinking", "thinking_delta", "stop", "start text", "text_delta",
                             "stop", "message_delta", "message_stop"], [e.type for e in events]
    block_indices_hold(events)
    start = events[0].message
    assert start.content == [] and start.role == "assistant" and start.id.startswith("msg_")
    assert start.stop_reason is None and prompt_tokens(start.usage) == prompt_tokens(whole.usage)
    assert events[1].content_block.thinking == "" and events[1].content_block.signature == ""
    assert deltas(events, "thinking_delta", "thinking") == REASONING
    assert deltas(events, "text_delta", "text") == ANSWER
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("end_turn", None)
    assert delta.usage.output_tokens == whole.usage.output_tokens
    assert blocks(final) == blocks(whole) == [("thinking", REASONING, ""), ("text", ANSWER)]
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == (
        "end_turn", None, whole.usage.output_tokens)
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    # message_start goes out once the prompt is prefilled: the cache's share is known then
    assert start.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens > 0
    assert start.usage.input_tokens == final.usage.input_tokens


def test_the_stream_on_the_wire(thinking: Server, thinking_name: str) -> None:
    """`event: NAME` names each `data:` object's own type; no `[DONE]`."""
    events = sse(thinking, {"model": thinking_name, "messages": HI, "max_tokens": 40, "temperature": 0,
                            "stream": True})
    assert all(name == data["type"] for name, data in events), events
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert set(names) == RAW_EVENTS, names
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == ANSWER


def test_max_tokens_cuts_the_answer(client: Any, thinking_name: str) -> None:
    out = create(client, thinking_name, max_tokens=3)  # "<think>", " alpha", " beta"
    assert (out.stop_reason, out.stop_sequence) == ("max_tokens", None)
    assert blocks(out) == [("thinking", REASONING, "")]  # no text: an empty text block is left out
    assert out.usage.output_tokens == 3
    events, final = streamed(client, thinking_name, max_tokens=3)
    assert blocks(final) == blocks(out) and final.stop_reason == "max_tokens"
    assert "start text" not in shape(events)


def test_a_stop_sequence(client: Any, thinking_name: str) -> None:
    out = create(client, thinking_name, stop_sequences=["beta"])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", "beta")
    assert blocks(out) == [("thinking", "alpha", "")]  # the stop string is not in the output
    out = create(client, thinking_name, stop_sequences=["nowhere", ANSWER])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", ANSWER)
    assert blocks(out) == [("thinking", REASONING, "")]
    events, final = streamed(client, thinking_name, stop_sequences=["beta"])
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "beta")
    assert blocks(final) == [("thinking", "alpha", "")] and final.stop_sequence == "beta"


def test_thinking_disabled(client: Any, thinking_name: str) -> None:
    """The prompt closes an empty think block (`enable_thinking` false): nothing is split
    off, and the model's script is all text."""
    out = create(client, thinking_name, thinking={"type": "disabled"})
    assert blocks(out) == [("text", UNSPLIT)]
    assert out.stop_reason == "end_turn"
    disabled, default = count(client, thinking_name, thinking={"type": "disabled"}), count(client, thinking_name)
    assert prompt_tokens(out.usage) == disabled > default  # "<think>\n\n</think>\n\n" in the prompt
    _, final = streamed(client, thinking_name, thinking={"type": "disabled"})
    assert blocks(final) == [("text", UNSPLIT)]
    enabled = create(client, thinking_name, thinking={"type": "enabled", "budget_tokens": 100}, max_tokens=200)
    assert blocks(enabled) == [("thinking", REASONING, ""), ("text", ANSWER)]
    assert count(client, thinking_name, thinking={"type": "enabled", "budget_tokens": 100}) == default


def test_system_and_history(client: Any, thinking_name: str) -> None:
    """A system prompt (string or text blocks) and an earlier turn with its thinking block
    reach the prompt; the model writes its script after any generation prompt."""
    base = count(client, thinking_name)
    plain = count(client, thinking_name, system="be brief")
    assert plain > base
    assert count(client, thinking_name, system=[{"type": "text", "text": "be brief"}]) == plain
    out = create(client, thinking_name, system=[{"type": "text", "text": "be brief"}])
    assert prompt_tokens(out.usage) == plain and blocks(out) == [("thinking", REASONING, ""), ("text", ANSWER)]
    history = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                                      {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": [{"type": "text", "text": "and again"}]}]
    out = create(client, thinking_name, history)
    assert blocks(out) == [("thinking", REASONING, ""), ("text", ANSWER)]
    assert prompt_tokens(out.usage) == count(client, thinking_name, history) > base


# ---------------------------------------------------------------- errors and keys


def test_missing_max_tokens(client: Any, thinking: Server, thinking_name: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=object, body={"model": thinking_name, "messages": HI})
    assert "max_tokens" in raised(e.value, "invalid_request_error")
    r = thinking.post("/v1/messages", {"model": thinking_name, "messages": HI})
    assert "max_tokens" in anthropic_error(r, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, thinking_name, max_tokens=-1)  # (0 is taken: the server reads it as cache pre-warming)
    assert "max_tokens" in raised(e.value, "invalid_request_error")


@pytest.mark.parametrize(("kw", "field"), [
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "be brief"}, *HI]}, "messages"),
], ids=["bash-server-tool", "web-search-server-tool", "no-messages", "system-role-in-messages"])
def test_refused_requests(client: Any, thinking: Server, thinking_name: str, kw: dict[str, Any], field: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, thinking_name, **kw)
    assert field in raised(e.value, "invalid_request_error")
    body = {"model": thinking_name, "messages": HI, "max_tokens": 10, **kw}
    assert field in anthropic_error(thinking.post("/v1/messages", body), 400, "invalid_request_error")


def test_other_errors_are_anthropics_shape(thinking: Server, thinking_name: str) -> None:
    anthropic_error(thinking.post("/v1/messages/nowhere", {}), 404, "not_found_error")
    big = {"model": thinking_name, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * (MAX_BYTES + 10_000)}]}
    anthropic_error(thinking.post("/v1/messages", big), 413, "request_too_large")
    r = thinking.post("/v1/messages", content=b"{not json", headers=thinking.headers | {"content-type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error")


def test_api_keys(thinking: Server, thinking_name: str) -> None:
    body = {"model": thinking_name, "messages": HI, "max_tokens": 40, "temperature": 0}
    with (anthropic.Anthropic(base_url=thinking.url, api_key="sk-wrong", max_retries=0, timeout=60) as wrong,
          pytest.raises(anthropic.AuthenticationError) as e):
        create(wrong, thinking_name)
    raised(e.value, "authentication_error")
    anthropic_error(httpx.post(thinking.url + "/v1/messages", json=body, timeout=TIMEOUT), 401, "authentication_error")
    anthropic_error(httpx.post(thinking.url + "/v1/messages", json=body, timeout=TIMEOUT,
                               headers={"x-api-key": "sk-wrong"}), 401, "authentication_error")
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = httpx.post(thinking.url + "/v1/messages", json=body, timeout=TIMEOUT, headers=headers)
        assert r.status_code == 200 and r.json()["content"][-1]["text"] == ANSWER, (headers, r.text)
    with anthropic.Anthropic(base_url=thinking.url, auth_token=KEY, max_retries=0, timeout=60) as bearer:
        assert blocks(create(bearer, thinking_name))[-1] == ("text", ANSWER)


def test_the_model_list_reads_in_either_client(client: Any, thinking: Server, thinking_name: str) -> None:
    """`GET /v1/models` carries Anthropic's model fields and paging beside OpenAI's."""
    page = client.models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [(thinking_name, "model", thinking_name)]
    assert page.data[0].created_at.year >= 2024 and page.has_more is False
    listed = httpx.get(thinking.url + "/v1/models", headers={"x-api-key": KEY}, timeout=TIMEOUT).json()
    assert listed["object"] == "list" and listed["data"][0]["object"] == "model"  # OpenAI's shape still
    assert (listed["first_id"], listed["last_id"]) == (thinking_name, thinking_name)


# ---------------------------------------------------------------- tools (the coder model)


@pytest.mark.parametrize("tool_choice", [None, {"type": "auto"}, {"type": "auto", "disable_parallel_tool_use": True}],
                         ids=["default", "auto", "auto-no-parallel"])
def test_a_call_beside_text(tools_client: Any, coder_name: str, tool_choice: Any) -> None:
    kw = {"tool_choice": tool_choice} if tool_choice else {}
    out = create(tools_client, coder_name, MESSAGES, tools=[WEATHER], max_tokens=80, **kw)
    assert blocks(out) == [("text", CONTENT), ("tool_use", "get_weather", ARGUMENTS)]
    assert (out.stop_reason, out.stop_sequence) == ("tool_use", None)
    assert out.content[1].id.startswith("toolu_")
    assert isinstance(out.content[1].input["days"], int)
    assert prompt_tokens(out.usage) == count(tools_client, coder_name, MESSAGES, tools=[WEATHER])


def test_the_raw_tool_use_block(coder: Server, coder_name: str) -> None:
    r = coder.post("/v1/messages", {"model": coder_name, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 80,
                                    "temperature": 0})
    assert r.status_code == 200, r.text
    call = r.json()["content"][-1]
    assert set(call) == {"type", "id", "name", "input"} and call["id"].startswith("toolu_"), call
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "get_weather", ARGUMENTS)


def test_a_streamed_call_beside_text(tools_client: Any, coder_name: str) -> None:
    whole = create(tools_client, coder_name, MESSAGES, tools=[WEATHER], max_tokens=80)
    events, final = streamed(tools_client, coder_name, MESSAGES, tools=[WEATHER], max_tokens=80)
    assert shape(events) == ["message_start", "start text", "text_delta", "stop", "start tool_use", "input_json_delta",
                             "stop", "message_delta", "message_stop"], [e.type for e in events]
    block_indices_hold(events)
    assert deltas(events, "text_delta", "text") == CONTENT
    header = next(e.content_block for e in events if e.type == "content_block_start" and e.index == 1)
    assert header.name == "get_weather" and header.id.startswith("toolu_") and header.input == {}
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == ARGUMENTS, pieces
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "tool_use"
    assert blocks(final) == blocks(whole) == [("text", CONTENT), ("tool_use", "get_weather", ARGUMENTS)]
    assert final.stop_reason == "tool_use" and final.content[1].id == header.id


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_time"}, {"type": "tool", "name": "get_weather"},
                                         {"type": "any"}], ids=["get_time", "get_weather", "any"])
def test_a_forced_call(tools_client: Any, coder_name: str, tool_choice: dict[str, Any]) -> None:
    out = create(tools_client, coder_name, MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80)
    assert out.stop_reason == "tool_use"
    [call] = out.content  # no text before a forced call
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name in SCHEMAS, out.content
    assert call.name == tool_choice.get("name", call.name)
    jsonschema.validate(call.input, SCHEMAS[call.name])
    if call.name == "get_time":
        assert call.input == {}


def test_a_streamed_forced_call(tools_client: Any, coder_name: str) -> None:
    events, final = streamed(tools_client, coder_name, MESSAGES, tools=[WEATHER, TIME],
                             tool_choice={"type": "tool", "name": "get_time"}, max_tokens=80)
    assert "start text" not in shape(events)
    assert blocks(final) == [("tool_use", "get_time", {})] and final.stop_reason == "tool_use"
    assert json.loads(deltas(events, "input_json_delta", "partial_json") or "{}") == {}


def test_no_calls_when_tool_choice_is_none(tools_client: Any, coder_name: str) -> None:
    out = create(tools_client, coder_name, MESSAGES, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=80)
    assert not [b for b in out.content if b.type == "tool_use"], out.content
    assert blocks(out) == [("text", SCRIPT_TEXT)] and out.stop_reason == "end_turn"
    _, final = streamed(tools_client, coder_name, MESSAGES, tools=[WEATHER], tool_choice={"type": "none"},
                        max_tokens=80)
    assert blocks(final) == [("text", SCRIPT_TEXT)] and final.stop_reason == "end_turn"


def test_a_call_and_its_result_go_back(tools_client: Any, coder_name: str) -> None:
    first = create(tools_client, coder_name, MESSAGES, tools=[WEATHER], max_tokens=80)
    call = first.content[1]

    def turn(content: Any, **result: Any) -> list[dict[str, Any]]:
        return [*MESSAGES,
                {"role": "assistant", "content": [{"type": "text", "text": CONTENT},
                                                  {"type": "tool_use", "id": call.id, "name": call.name,
                                                   "input": call.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": content,
                                              **result}]}]

    sizes = []
    for messages in (turn("sunny"), turn([{"type": "text", "text": "sunny"}]), turn("sunny", is_error=False),
                     turn("no such city", is_error=True)):
        out = create(tools_client, coder_name, messages, tools=[WEATHER], max_tokens=80)
        assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
        # the template writes the earlier call and its result; the model then writes its script again
        assert blocks(out) == [("text", CONTENT), ("tool_use", "get_weather", ARGUMENTS)]
        assert out.stop_reason == "tool_use" and out.content[1].id != call.id
        assert prompt_tokens(out.usage) == count(tools_client, coder_name, messages, tools=[WEATHER])
        sizes.append(prompt_tokens(out.usage))
    assert sizes[0] == sizes[1] == sizes[2] > prompt_tokens(first.usage)  # a string or a text block: the same prompt
    longer = count(tools_client, coder_name, turn("sunny, and warm all week in Paris and Rome"), tools=[WEATHER])
    assert longer > sizes[0]  # the result's text reaches the prompt


def test_a_client_gone_mid_stream_frees_its_slots(server: Server) -> None:
    """A Messages stream closed after its first events aborts its request: the session
    server (tiny llama) is idle long before 900 tokens, its KV intact."""
    server.wait_idle()
    server.post("/flush_cache")
    idle = server.wait_idle()
    body = {"model": model_name(server), "max_tokens": 900, "stream": True,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=TIMEOUT) as r:
        events = (line for line in r.iter_lines() if line.startswith("event: "))
        assert next(events) == "event: message_start"
        next(events)
    after = server.wait_idle()
    assert after["kv_available"] + after["kv_evictable"] == idle["kv_size"]
    assert after["kv_evictable"] < 900  # the request did not run to the end
    server.post("/flush_cache")
