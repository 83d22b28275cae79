"""gpt-oss's harmony format on the real server, driven by the official `openai` client,
with a scripted checkpoint that writes harmony through gpt-oss's own chat template
(tests/runtime/harmony_checkpoint.py): the analysis channel arrives as `reasoning_content`,
the final channel as content, a message to `functions.get_weather` as a tool call (whole
and streamed), and a call's result rendered back through the template gets the answer.
Constraints hold the final channel only, and beside tools a call may be the answer; a
forced call, of one function or one of several, is written in harmony form after the
model's analysis. No
marker ever reaches a client of the chat or Responses API, while `/generate` decodes as
it always did."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from harmony_checkpoint import (
    ANSWER,
    ARGS,
    PLAIN,
    REASONING,
    TOOL_RESULT,
    WEATHER,
    build_harmony_checkpoint,
)
from server_helpers import Server, running_server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {}}}}
SCHEMA = WEATHER["function"]["parameters"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_harmony_checkpoint(tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    with running_server(model, "--reasoning-parser", "gpt-oss") as s:  # calls: "auto" finds harmony in the template
        yield s


@pytest.fixture(autouse=True)
def intact_after(server: Server) -> Iterator[None]:
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


def chat(client: Any, messages: list[dict[str, Any]] = MESSAGES, **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, **{"temperature": 0, "max_tokens": 40, **kw})


def no_markers(*texts: str | None) -> bool:
    return not any("<|" in (t or "") for t in texts)


def test_reasoning_and_answer(client: Any) -> None:
    out = chat(client)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == (REASONING, ANSWER, None)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens_details.reasoning_tokens == 2  # " alpha", " beta"
    unsplit = chat(client, extra_body={"separate_reasoning": False}).choices[0].message
    assert unsplit.content == REASONING + "\n" + ANSWER and not getattr(unsplit, "reasoning_content", None)
    asked = chat(client, extra_body={"skip_special_tokens": True}).choices[0].message  # markers are kept anyway
    assert (asked.reasoning_content, asked.content) == (REASONING, ANSWER)


def test_streamed_reasoning_and_answer(client: Any) -> None:
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert no_markers(*(d.content for d in deltas), *(getattr(d, "reasoning_content", None) for d in deltas))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 2


def test_a_tool_call_and_its_result_round_trip(client: Any) -> None:
    """The model calls get_weather; the call (with its reasoning, as `reasoning_content`)
    and the tool's result go back through gpt-oss's template, and the model answers at
    once: its script skips the analysis when the prompt holds it, and calls nothing once
    the prompt holds a result."""
    first = chat(client, tools=[WEATHER]).choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS) and call.id.startswith("call_")
    assert (first.message.content, first.message.reasoning_content) == (None, REASONING)
    history = [*MESSAGES, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    answered = chat(client, history, tools=[WEATHER]).choices[0]
    assert answered.finish_reason == "stop" and answered.message.tool_calls is None
    assert (answered.message.content, answered.message.reasoning_content) == (ANSWER, None)
    without_reasoning = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in history]
    thought_again = chat(client, without_reasoning, tools=[WEATHER]).choices[0].message
    assert (thought_again.reasoning_content, thought_again.content) == (REASONING, ANSWER)


def test_a_streamed_tool_call(client: Any) -> None:
    chunks = [c.choices[0] for c in chat(client, tools=[WEATHER, TIME], stream=True)]
    pieces = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather"
    assert {p.index for p in pieces} == {0} and "".join(p.function.arguments or "" for p in pieces) == ARGS
    assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) == REASONING
    assert not any(c.delta.content for c in chunks) and chunks[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize(("max_tokens", "reasoning", "content", "call"), [
    (4, " alpha", "", None),  # cut in the analysis
    (14, REASONING, None, ""),  # cut right after the call's header: the call, its arguments not begun
])
def test_an_output_cut_short(client: Any, max_tokens: int, reasoning: str, content: str | None,
                             call: str | None) -> None:
    tools = {"tools": [WEATHER]} if call is not None else {}
    choice = chat(client, max_tokens=max_tokens, **tools).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.reasoning_content, choice.message.content) == (reasoning, content)
    assert [c.function.arguments for c in choice.message.tool_calls or ()] == ([call] if call is not None else [])


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_is_written_in_harmony(client: Any, choice: Any) -> None:
    """A grammar holds the whole turn: the model thinks first (its analysis is the
    reasoning), then calls, its arguments held to the schema."""
    out = chat(client, tools=[WEATHER], tool_choice=choice).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    assert out.message.reasoning_content == REASONING
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(ARGS)


@pytest.mark.parametrize(("choice", "name"), [("required", "get_weather"),
                                              ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_a_call_forced_among_several_functions(client: Any, choice: Any, name: str) -> None:
    """"required" among several functions: the model's own choice (the script calls
    get_weather); a named one the model would not call: the grammar writes its name, and
    its arguments hold to its schema."""
    out = chat(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None, out
    [call] = out.message.tool_calls
    assert call.function.name == name and no_markers(call.function.arguments)
    jsonschema.validate(json.loads(call.function.arguments), (WEATHER if name == "get_weather" else TIME)["function"][
        "parameters"])


def test_what_harmony_cannot_force_is_a_400_naming_the_field(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[WEATHER], tool_choice=NAMED, response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
    assert chat(client, reasoning_effort="low").choices[0].message.content == ANSWER


def test_response_format_holds_the_final_channel(client: Any) -> None:
    """The model thinks first, unconstrained, and the final channel's text matches the
    schema: were the grammar applied from the first token, there would be no reasoning."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    out = chat(client, response_format=fmt).choices[0]
    assert out.message.reasoning_content == REASONING and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), SCHEMA)


def test_beside_tools_a_call_or_an_answer_held_to_response_format(client: Any) -> None:
    """tool_choice "auto" with `response_format` (what the OpenAI Agents SDK sends for an
    agent with tools and a structured output): the model's call ends its output before
    any final channel, with `<|call|>`; once the tool's result is in, the final channel
    is held to the schema (the script would answer " gamma" there)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    first = chat(client, tools=[WEATHER], response_format=fmt).choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    assert (first.message.content, first.message.reasoning_content) == (None, REASONING)
    streamed = list(chat(client, tools=[WEATHER], response_format=fmt, stream=True))
    pieces = [t for c in streamed for t in c.choices[0].delta.tool_calls or ()]
    assert "".join(p.function.arguments or "" for p in pieces) == ARGS
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    history = [*MESSAGES, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}]
    answered = chat(client, history, tools=[WEATHER], response_format=fmt).choices[0]
    assert answered.finish_reason == "stop" and answered.message.tool_calls is None
    jsonschema.validate(json.loads(answered.message.content), SCHEMA)


def test_responses_reasoning_and_function_call_items(client: Any, server: Server) -> None:
    r = client.responses.create(model="m", input=MESSAGES[0]["content"], temperature=0, max_output_tokens=40)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == 2
    tools = [{"type": "function", **WEATHER["function"]}]
    called = client.responses.create(model="m", input=MESSAGES[0]["content"], tools=tools, temperature=0,
                                     max_output_tokens=40)
    assert [i.type for i in called.output] == ["reasoning", "function_call"]
    call = called.output[1]
    assert (call.name, call.arguments) == ("get_weather", ARGS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    chained = client.responses.create(model="m", previous_response_id=called.id, input=[result], tools=tools,
                                      temperature=0, max_output_tokens=40)
    # the reasoning item went back with the call (the template keeps a call's analysis): no thinking again
    assert chained.output_text == ANSWER and [i.type for i in chained.output] == ["message"]
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "model": "m", "input": MESSAGES[0]["content"], "tools": tools, "temperature": 0, "stream": True}) as s:
        events = [orjson.loads(line.removeprefix("data: ")) for line in s.iter_lines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("arguments")) for i in done] == [("reasoning", None), ("function_call", ARGS)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == REASONING
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", reasoning={"effort": "extreme"})
    assert "reasoning.effort" in e.value.body["message"]


def test_anthropic_messages_thinking_text_and_tool_use(server: Server) -> None:
    """Anthropic's Messages API on harmony: the analysis is a thinking block, the final
    channel a text block, a call a tool_use block (whole and streamed), and a tool_result
    sent back gets the answer; a forced call goes through the grammar of the whole turn."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    ask = {"model": "m", "max_tokens": 60, "messages": MESSAGES, "extra_body": {"temperature": 0}}
    m = c.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", REASONING), ("text", ANSWER)] and m.stop_reason == "end_turn"
    tool = {"name": "get_weather", "description": "Get the weather", "input_schema": SCHEMA}
    called = c.messages.create(**ask, tools=[tool])
    assert [b.type for b in called.content] == ["thinking", "tool_use"] and called.stop_reason == "tool_use"
    use = called.content[1]
    assert (use.name, use.input) == ("get_weather", json.loads(ARGS)) and use.id.startswith("toolu_")
    with c.messages.stream(**ask, tools=[tool]) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == [("thinking", None),
                                                                             ("tool_use", json.loads(ARGS))]
    back = [*MESSAGES, {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                                         {"type": "tool_use", "id": use.id, "name": use.name,
                                                          "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]}]
    answered = c.messages.create(**{**ask, "messages": back}, tools=[tool])
    assert answered.content[-1].type == "text" and answered.content[-1].text == ANSWER
    forced = c.messages.create(**ask, tools=[tool], tool_choice={"type": "any"})
    assert [b.type for b in forced.content] == ["thinking", "tool_use"] and forced.content[1].input == json.loads(ARGS)


def test_generate_and_completions_decode_as_asked(server: Server) -> None:
    """Only the chat routes keep the markers; the native route drops special tokens by
    default and keeps them when asked, as before."""
    text = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    plain = server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 40}})["text"]
    kept = server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                              "skip_special_tokens": False}})["text"]
    assert kept == PLAIN and plain == "analysis alpha betaassistantfinal gamma"
    completion = server.post("/v1/completions", {"prompt": text, "max_tokens": 40, "temperature": 0}).json()
    assert completion["choices"][0]["text"] == plain


def test_the_script_is_what_transformers_generates(model: Path) -> None:
    """The checkpoint's script, as the reference implementation runs it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, hf = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = hf.generate(**ids, max_new_tokens=40, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]) == PLAIN


def test_a_thinking_budget_is_refused_and_anthropic_budget_tokens_accepted(server: Server) -> None:
    """A budget's closing marker could cut a tool call the analysis holds: a 400 naming the
    field (use reasoning_effort). Anthropic's `budget_tokens`, which its clients must send
    with thinking on, is accepted and not enforced, as on any server without think markers."""
    messages = [{"role": "user", "content": "hi"}]
    for field in ("thinking_budget", "thinking_token_budget"):
        r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, field: 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "reasoning_effort" in r.json()["error"]["message"]
    r = server.post("/v1/messages", {"model": "m", "max_tokens": 8, "messages": messages,
                                     "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert r.status_code == 200, r.text
