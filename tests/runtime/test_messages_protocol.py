"""Anthropic's Messages API without a server: a request read as the chat request it
means (every block kind, tools, tool_choice, thinking, output_config, prefill), errors
naming the Messages field, and the streamed content blocks built from chat deltas."""

from __future__ import annotations

import json

import orjson
import pytest

from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.messages_output import BlockStream, content_blocks, stop_reason, usage
from sprig.runtime.server.messages_protocol import MessagesRequest, renamed, to_chat

WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PNG = "iVBORw0KGgo="


def chat(budgets: bool = True, **body):
    return to_chat(parse(MessagesRequest, {"model": "m", "max_tokens": 16, **body}), budgets=budgets)


def test_a_conversation_with_tool_use_and_results_becomes_chat_messages() -> None:
    req = chat(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
               stop_sequences=["END"], messages=[
                   {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                                {"type": "text", "text": "Paris?"}]},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "Need a tool.", "signature": "abc"},
                       {"type": "text", "text": "Checking."},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}]},
                       {"type": "text", "text": "And Rome?"}]}])
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need a tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And Rome?"},
    ]
    assert req.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                           "parameters": WEATHER["input_schema"]}}]
    assert req.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert req.parallel_tool_calls is False and req.stop == ["END"] and req.max_completion_tokens == 16
    assert req.add_generation_prompt and not req.continue_final_message


@pytest.mark.parametrize(("choice", "expected"), [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                                  ({"type": "none"}, "none")])
def test_tool_choice(choice, expected) -> None:
    assert chat(tools=[WEATHER], tool_choice=choice, messages=[{"role": "user", "content": "hi"}]).tool_choice == expected


def test_images_thinking_output_config_and_prefill() -> None:
    req = chat(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "text", "text": "What is this?"}]}, {"role": "assistant", "content": "It is"}],
        thinking={"type": "disabled"}, output_config={"effort": "max", "format": {
            "type": "json_schema", "schema": {"type": "object"}}})
    parts = [p.model_dump(exclude_none=True) for p in req.messages[0].content]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert parts[0]["image_url"]["url"] == f"data:image/png;base64,{PNG}"
    assert req.chat_template_kwargs == {"enable_thinking": False} and req.reasoning_effort == "high"
    assert req.response_format.model_dump(by_alias=True, exclude_none=True)["json_schema"]["schema"] == {"type": "object"}
    assert req.continue_final_message and not req.add_generation_prompt  # prefill
    assert chat(messages=[{"role": "user", "content": "x"}], thinking={"type": "adaptive"}).chat_template_kwargs is None


def test_budget_tokens_is_a_thinking_budget_where_the_server_enforces_one() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert chat(**body).thinking_budget == 1024
    assert chat(budgets=False, **body).thinking_budget is None
    assert chat(messages=body["messages"], thinking={"type": "disabled", "budget_tokens": 9}).thinking_budget is None


@pytest.mark.parametrize(("body", "field", "says"), [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages",
     "messages[0].content[0].type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages", "messages[0].content[0].source"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
     "messages", "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "s"}]},
     "tools", "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}, "tools", "input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": {"type": "tool"}},
     "tool_choice", "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"type": "url", "url": "https://mcp.test",
                                                                       "name": "m"}]}, "mcp_servers", "MCP"),
    ({"messages": [{"role": "user", "content": "x"}], "container": "container_1"}, "container", "container"),
])
def test_what_cannot_be_read_is_a_400_naming_the_field(body, field: str, says: str) -> None:
    with pytest.raises(ApiError, match=says.replace("[", r"\[").replace("]", r"\]")) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == field


def test_body_errors_name_the_messages_field() -> None:
    for body, field in (({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                        ({"model": "m", "max_tokens": 1, "messages": []}, "messages"),
                        ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                          "thinking": {"type": "sometimes"}}, "thinking")):
        with pytest.raises(ApiError) as e:
            parse(MessagesRequest, body)
        assert e.value.param == field and e.value.message.startswith(field)
    assert renamed(ApiError(400, "max_completion_tokens: too many", "max_completion_tokens")).message == (
        "max_tokens: too many")


def test_content_blocks_stop_reasons_and_usage() -> None:
    message = {"role": "assistant", "content": "Checking.", "reasoning_content": "Hmm.",
               "tool_calls": [{"id": "call_ab", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                              {"id": "call_cd", "type": "function", "function": {"name": "f", "arguments": '{"x": '}}]}
    assert content_blocks(message) == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""}, {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_ab", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "tool_use", "id": "toolu_cd", "name": "f", "input": {}}]  # cut short by max_tokens
    assert stop_reason({"type": "stop", "matched": 2}, False, None) == ("end_turn", None)
    assert stop_reason({"type": "stop", "matched": "END"}, False, ["END"]) == ("stop_sequence", "END")
    assert stop_reason({"type": "length", "length": 4}, False, None) == ("max_tokens", None)
    assert stop_reason({"type": "stop", "matched": 2}, True, None) == ("tool_use", None)
    assert usage({"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 8}) == {
        "input_tokens": 2, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 8}


def test_streamed_deltas_become_consecutive_blocks() -> None:
    stream = BlockStream()
    events = [*stream.feed({"reasoning_content": "Hm"}), *stream.feed({"reasoning_content": "m."}),
              *stream.feed({"content": "Sure."}),
              *stream.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                            "function": {"name": "f", "arguments": '{"a": '}}]}),
              *stream.feed({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}},
                                           {"index": 1, "id": "call_2", "type": "function",
                                            "function": {"name": "g", "arguments": "{}"}}]}),
              *stream.finish()]
    read = []
    for raw in events:
        head, data = raw.decode().rstrip("\n").split("\n")
        body = orjson.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        read.append(body)
    assert [(e["type"], e.get("index")) for e in read] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3)]
    assert read[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert read[3]["delta"] == {"type": "signature_delta", "signature": ""}
    assert read[8]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in read[9:11]) == '{"a": 1}'
