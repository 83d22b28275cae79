"""A stored response's input items, as `GET /v1/responses/{id}/input_items` lists them.

Items are kept as OpenAI lists them (`as_listed`): each has an `id` (the client's, or a
new one), a `status`, and a message's content is a list of text parts. A response's input
items are every item it was generated after, in conversation order: its predecessors'
input and output (through `previous_response_id`), then its own input. Its
`instructions` are not an item (they are not carried on either).

A page (`item_page`) is OpenAI's cursor list: `order` "desc" (the default) lists the
newest first; `after` / `before` name an item id the page starts after / ends before, in
that order; `has_more` says whether items lie beyond the page's end."""

from __future__ import annotations

from typing import Any, Literal

from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.responses_output import new_id

MAX_LIMIT = 100
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def as_listed(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated input items (`responses_protocol.input_messages` read them) in their
    listed form; the items given are not changed."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        listed = {**item, "type": kind, "id": item.get("id") or new_id(_ID_PREFIX[kind])}
        listed.setdefault("status", "completed")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            extra = {"annotations": []} if part == "output_text" else {}
            listed["content"] = [{"type": part, "text": item["content"], **extra}]
        out.append(listed)
    return out


def item_page(items: list[dict[str, Any]], *, limit: int, order: Literal["asc", "desc"], after: str | None,
              before: str | None) -> dict[str, Any]:
    """One page of `items` (in conversation order) as OpenAI's list object. Raises a 400
    naming `after` or `before` when it names no item."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = _index(ids, after, "after") + 1 if after is not None else 0
    end = _index(ids, before, "before") if before is not None else len(ordered)
    window = ordered[start:end]
    data = window[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(window) > limit}


def _index(ids: list[str], item_id: str, field: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise ApiError(400, f"{field}: no item {item_id!r} among this response's input items", field) from None
