"""The Responses API's pure parts: input items read as chat messages and listed (ids, and
cursor pages), chat deltas written as output items and events, and the store's bounds
(bytes, least recently used first, one client's responses hidden from another)."""

from __future__ import annotations

import copy
import random

import pytest

from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.responses_items import as_listed, item_page
from sprig.runtime.server.responses_output import OutputStream, output_items
from sprig.runtime.server.responses_protocol import (
    ResponsesRequest,
    input_messages,
    renamed,
    to_chat,
)
from sprig.runtime.server.responses_store import ResponseStore

ITEMS = [
    {"role": "developer", "content": "Be brief."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                    {"type": "input_text", "text": "2 plus 3?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
    {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
    {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
    {"type": "function_call_output", "call_id": "c1", "output": "5"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]},
]


def test_items_become_the_chat_messages_of_the_same_conversation() -> None:
    items = ITEMS
    call = lambda i, a: {"id": i, "type": "function", "function": {"name": "add", "arguments": a}}  # noqa: E731
    assert input_messages(items, "input") == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "Let me add.",
         "tool_calls": [call("c1", '{"a": 2, "b": 3}'), call("c2", '{"a": 0, "b": 0}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "0"},
    ]


def test_a_reasoning_item_goes_with_the_assistant_turn_after_it() -> None:
    thought = {"type": "reasoning", "id": "rs_2", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Add "}, {"type": "reasoning_text", "text": "them."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
    answer = {"type": "message", "role": "assistant", "content": "5"}
    user = {"role": "user", "content": "again"}
    messages = input_messages([user, thought, call, thought, answer, thought, user], "input")
    assert [m.get("reasoning_content") for m in messages] == [None, "Add them.", "Add them.", None]
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant", "user"]


def test_the_chat_request_behind_a_response() -> None:
    req = ResponsesRequest.model_validate({
        "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "seed": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 3})
    history = [{"role": "user", "content": "Before."}, {"type": "message", "role": "assistant",
                                                        "content": [{"type": "output_text", "text": "Yes."}]}]
    chat = to_chat(req, history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Before."), ("assistant", "Yes."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.seed, chat.parallel_tool_calls) == (9, 0.5, 3, False)
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format.json_schema.schema_ == {"type": "object"} and chat.response_format.json_schema.strict
    assert chat.logprobs and chat.top_logprobs == 3


def test_errors_name_the_responses_field() -> None:
    assert renamed(ApiError(400, "response_format: bad schema", "response_format")).param == "text"
    e = renamed(ApiError(400, "messages is longer than any text", "messages"))
    assert (e.param, e.message) == ("input", "input is longer than any text")
    with pytest.raises(ApiError) as caught:
        input_messages([{"type": "message", "role": "tool", "content": "x"}], "input")
    assert "input[0].role" in caught.value.message


def _replay(deltas: list[dict]) -> OutputStream:
    out = OutputStream(logprobs=False)
    for d in deltas:
        out.feed(d, [])
    out.finish()
    return out


def test_a_stream_closes_each_item_before_the_next_and_ends_as_the_whole_answer() -> None:
    message = {"role": "assistant", "reasoning_content": "Add them.", "content": "Calling add.",
               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                              {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    deltas = [{"reasoning_content": "Add "}, {"reasoning_content": "them."}, {"content": "Calling"}, {"content": " add."},
              {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "add", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
              {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "add", "arguments": "{}"}}]}]
    out = _replay(deltas)
    whole = output_items(message, None)
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(out.items) == strip(whole)
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call", "function_call"]
    open_items: list[int] = []
    for kind, fields in out.events:
        if kind == "response.output_item.added":
            assert not open_items
            open_items.append(fields["output_index"])
        elif kind == "response.output_item.done":
            assert open_items.pop() == fields["output_index"]
            assert fields["item"] == out.items[fields["output_index"]]
        else:
            assert open_items == [fields["output_index"]], kind
    assert not open_items
    args = [f["delta"] for k, f in out.events if k == "response.function_call_arguments.delta"]
    assert args == ['{"a"', ": 1}", "{}"]


def test_the_store_keeps_the_recent_within_its_bytes_and_each_client_its_own() -> None:
    store = ResponseStore(max_bytes=4000)

    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"text": "x" * 300}]}]}

    for i in range(20):
        assert store.put(i % 2, response(i), [{"role": "user", "content": f"q{i}"}])
        assert store.held_bytes <= 4000
        assert store.get(0, "resp_0") is not None  # used every time: kept
    kept = {i for i in range(20) if store.get(i % 2, f"resp_{i}") is not None}
    assert 0 in kept and 19 in kept and 1 not in kept and len(kept) == len(store) < 20
    assert store.get(1, "resp_0") is None and not store.delete(1, "resp_0")
    assert store.get(0, "resp_0").items == [{"role": "user", "content": "q0"}, *response(0)["output"]]
    assert store.delete(0, "resp_0") and store.get(0, "resp_0") is None
    assert not store.put(0, {"id": "big", "output": [{"text": "y" * 5000}]}, [])
    assert ResponseStore(0).put(None, response(0), []) is False


def test_the_store_counts_its_bytes_through_any_order_of_puts_and_deletes() -> None:
    rng = random.Random(0)
    store = ResponseStore(max_bytes=3000)
    for _ in range(500):
        i = rng.randrange(30)
        if rng.random() < 0.3:
            store.delete(None, f"resp_{i}")
        else:
            store.put(None, {"id": f"resp_{i}", "output": [{"text": "z" * rng.randrange(600)}]}, [])
        assert store.held_bytes == sum(e.size for e in store._entries.values()) <= 3000


def test_listed_items_have_ids_and_text_parts_and_read_as_the_same_messages() -> None:
    items = [*copy.deepcopy(ITEMS), {"role": "assistant", "content": "Five."}]
    before = copy.deepcopy(items)
    listed = as_listed(items)
    assert items == before  # the client's items are not changed
    assert input_messages(listed, "input") == input_messages(items, "input")
    assert [i["id"].split("_")[0] for i in listed] == ["msg", "msg", "rs", "msg", "fc", "fc", "fco", "fco", "msg"]
    assert listed[2]["id"] == "rs_1" and len({i["id"] for i in listed}) == len(listed)
    assert all(i["status"] == "completed" and "type" in i for i in listed)
    assert listed[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert listed[-1]["content"] == [{"type": "output_text", "text": "Five.", "annotations": []}]
    assert as_listed(listed) == listed  # listing is idempotent: stored history is listed as it was


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pages_walked_by_their_last_id_list_every_item_once_in_order(order: str) -> None:
    items = [{"id": f"msg_{i}", "type": "message"} for i in range(7)]
    ordered = items if order == "asc" else items[::-1]
    for limit in range(1, 9):
        seen, after, pages = [], None, 0
        while True:
            page = item_page(items, limit=limit, order=order, after=after, before=None)
            pages += 1
            assert len(page["data"]) <= limit and page["object"] == "list"
            seen += page["data"]
            if not page["has_more"]:
                break
            after = page["last_id"]
            assert after == page["data"][-1]["id"] and page["first_id"] == page["data"][0]["id"]
        assert seen == ordered and pages == max(1, -(-7 // limit))
    page = item_page(items, limit=2, order=order, after=None, before=ordered[5]["id"])
    assert page["data"] == ordered[:2] and page["has_more"]
    page = item_page(items, limit=20, order=order, after=ordered[1]["id"], before=ordered[4]["id"])
    assert page["data"] == ordered[2:4] and not page["has_more"]
    last = item_page(items, limit=5, order=order, after=ordered[-1]["id"], before=None)
    assert last["data"] == [] and last["first_id"] is None and not last["has_more"]
    with pytest.raises(ApiError) as e:
        item_page(items, limit=5, order=order, after="msg_x", before=None)
    assert e.value.status == 400 and e.value.param == "after"
