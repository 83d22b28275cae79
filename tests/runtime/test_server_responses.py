"""`/v1/responses` driven by the official `openai` client on the demo model: a response is
the chat completion of the same conversation (same tokens, whole or streamed), its
calls and their outputs carry a conversation on (sent back as input, or through
`previous_response_id`), `text.format` constrains it, and what it cannot honour is a 400
naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from pydantic import BaseModel
from server_helpers import Server

openai = pytest.importorskip("openai")

PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
ADD = {"type": "function", "name": "add", "description": "Add two numbers", "parameters": PARAMETERS}
CHAT_ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": PARAMETERS}}
QUESTION = "What is 14 plus 9?"
TEXT = "Tara Costa is 29 years old. Tara lives in Oslo. Tara likes chess."


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def demo(demo_server: Server) -> Iterator[Server]:
    yield demo_server
    demo_server.wait_idle()


@pytest.fixture(scope="module")
def client(demo: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="sprig-demo", messages=messages, **kw).choices[0]


def events(demo: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, each `event:` line checked against its data's type."""
    with httpx.stream("POST", demo.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    out = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        event = orjson.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


def test_a_response_is_the_chat_completion_of_the_same_conversation(client: Any) -> None:
    for seed in range(3):
        r = client.responses.create(model="sprig-demo", instructions="Be brief.", input=QUESTION, temperature=0.9,
                                    max_output_tokens=40, extra_body={"seed": seed})
        c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                 temperature=0.9, seed=seed, max_tokens=40)
        assert r.output_text == c.message.content
        assert r.status == ("incomplete" if c.finish_reason == "length" else "completed")
        assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_the_stream_writes_the_response_it_ends_with(demo: Server, client: Any) -> None:
    body = {"input": QUESTION, "temperature": 0.9, "seed": 4, "max_output_tokens": 40}
    stream = events(demo, body)
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    assert [e["type"] for e in stream[:2]] == ["response.created", "response.in_progress"]
    final = stream[-1]["response"]
    assert stream[-1]["type"] == f"response.{final['status']}"
    text = "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta")
    done = [e["item"] for e in stream if e["type"] == "response.output_item.done"]
    assert done == final["output"] and text == final["output"][0]["content"][0]["text"]
    whole = demo.post("/v1/responses", body).json()
    assert [o["content"][0]["text"] for o in whole["output"]] == [text]


def test_a_call_and_its_output_carry_the_conversation_on(client: Any) -> None:
    """The demo model calls `add`, reads the result and answers; the second turn is the
    same sent whole as input, through `previous_response_id`, or as chat messages."""
    first = client.responses.create(model="sprig-demo", input=QUESTION, tools=[ADD], temperature=0,
                                    max_output_tokens=96)
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and first.status == "completed"
    args = json.loads(call.arguments)
    jsonschema.validate(args, PARAMETERS)
    direct = chat(client, [{"role": "user", "content": QUESTION}], tools=[CHAT_ADD], temperature=0, max_tokens=96)
    assert [(c.function.name, c.function.arguments) for c in direct.message.tool_calls] == [("add", call.arguments)]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])}
    chained = client.responses.create(model="sprig-demo", previous_response_id=first.id, input=[result],
                                      tools=[ADD], temperature=0, max_output_tokens=96)
    whole = client.responses.create(model="sprig-demo", tools=[ADD], temperature=0, max_output_tokens=96, input=[
        {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result])
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}]
    answer = chat(client, messages, tools=[CHAT_ADD], temperature=0, max_tokens=96).message.content
    assert chained.output_text == whole.output_text == answer
    assert answer.endswith(f"Answer: {args['a'] + args['b']}")
    assert chained.previous_response_id == first.id


def test_a_streamed_call_is_written_as_it_is_generated(demo: Server, client: Any) -> None:
    stream = events(demo, {"input": QUESTION, "tools": [ADD], "temperature": 0, "max_output_tokens": 96})
    kinds = [e["type"] for e in stream]
    pieces = [e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta") < kinds.index("response.function_call_arguments.done")
    [item] = stream[-1]["response"]["output"]
    assert item["type"] == "function_call" and "".join(pieces) == item["arguments"]
    whole = client.responses.create(model="sprig-demo", input=QUESTION, tools=[ADD], temperature=0,
                                    max_output_tokens=96)
    assert (item["name"], item["arguments"]) == (whole.output[0].name, whole.output[0].arguments)


def test_a_forced_call_names_the_function(client: Any) -> None:
    r = client.responses.create(model="sprig-demo", input="Tell me a story.", tools=[ADD], temperature=0,
                                tool_choice={"type": "function", "name": "add"}, max_output_tokens=64)
    assert [(o.type, o.name) for o in r.output] == [("function_call", "add")]
    jsonschema.validate(json.loads(r.output[0].arguments), PARAMETERS)


def test_text_format_parses_into_a_pydantic_model(client: Any) -> None:
    r = client.responses.parse(model="sprig-demo", input=TEXT, text_format=Person, temperature=0,
                               max_output_tokens=80)
    assert isinstance(r.output_parsed, Person)
    assert r.output_parsed.age == 29 and r.output_parsed.city == "Oslo"
    loose = client.responses.create(model="sprig-demo", input=TEXT, text={"format": {"type": "json_object"}},
                                    temperature=0.8, extra_body={"seed": 1}, max_output_tokens=80)
    assert isinstance(json.loads(loose.output_text), dict)


def test_cut_at_max_output_tokens_is_incomplete(client: Any) -> None:
    r = client.responses.create(model="sprig-demo", input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_logprobs_when_included(client: Any) -> None:
    r = client.responses.create(model="sprig-demo", input=QUESTION, temperature=0, max_output_tokens=8,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    [part] = r.output[0].content
    direct = chat(client, [{"role": "user", "content": QUESTION}], temperature=0, max_tokens=8, logprobs=True,
                  top_logprobs=2).logprobs.content
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [(lp.token, lp.logprob) for lp in direct]
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text)  # and the stop token, as chat's
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in part.logprobs)


def test_stored_responses_are_read_deleted_and_not_kept_when_told(client: Any) -> None:
    r = client.responses.create(model="sprig-demo", input=QUESTION, temperature=0, max_output_tokens=8)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model="sprig-demo", input=QUESTION, store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="sprig-demo", input=QUESTION, previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_input_items_list_the_conversation_a_response_followed(demo: Server, client: Any) -> None:
    """A chained response's input items are its predecessor's input and output, then its
    own input, each with an id; pages walked by the client list them all, newest first."""
    first = client.responses.create(model="sprig-demo", instructions="Be brief.", temperature=0,
                                    max_output_tokens=8, input=[
                                        {"role": "user", "content": "Hello."},
                                        {"role": "assistant", "content": "Hi."},
                                        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    second = client.responses.create(model="sprig-demo", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=8, input="And 2 plus 2?")
    own = client.responses.input_items.list(first.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in own] == [("user", "Hello."), ("assistant", "Hi."), ("user", QUESTION)]
    listed = list(client.responses.input_items.list(second.id, order="asc", limit=2))
    assert [i.id for i in listed[:3]] == [i.id for i in own]
    assert [i.model_dump(exclude_none=True) for i in listed[3:-1]] == \
        [o.model_dump(exclude_none=True) for o in first.output]
    assert (listed[-1].type, listed[-1].role, listed[-1].content[0].text) == ("message", "user", "And 2 plus 2?")
    assert all(i.status == "completed" for i in listed) and len({i.id for i in listed}) == len(listed)
    newest = client.responses.input_items.list(second.id, limit=3)
    assert [i.id for i in newest.data] == [i.id for i in listed[::-1][:3]] and newest.has_more
    assert not client.responses.input_items.list(second.id, limit=100).has_more
    for query, param in [("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"), ("after=msg_x", "after")]:
        r = demo.get(f"/v1/responses/{second.id}/input_items?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(first.id)
    assert len(list(client.responses.input_items.list(second.id))) == len(listed)  # stored with its history


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "hi", "tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice", "sub"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "n": 2}, "n", "one output"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text", "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": []}, "input", "at least one message"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "reasoning.effort"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(demo: Server, body: dict[str, Any], param: str,
                                                           words: str) -> None:
    r = demo.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    demo.wait_idle()
