"""A chat answer written back as Anthropic's Messages API has it: the message object
(`message_object`: content blocks, stop reason, usage) and, for a stream, the events that
build it block by block (`BlockStream`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a tool call whose chat id is `call_id` (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's `input`: its arguments' JSON object; {} for arguments cut short by
    `max_tokens` (the stop reason says so)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant chat message (`AnswerFormat.message`) as content blocks: its
    reasoning (`thinking`), its text, then its tool calls (`tool_use`)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks


def stop_reason(finish: dict[str, Any] | None, called: bool, stops: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of an output that ended with SGLang's `finish`:
    complete tool calls are `tool_use`, a length limit `max_tokens`, a matched stop
    sequence `stop_sequence` (with it), any other stop `end_turn`."""
    if finish is None:
        return None, None
    if called:
        return "tool_use", None
    if finish["type"] == "length":
        return "max_tokens", None
    matched = finish.get("matched")
    if isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage(meta: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage of a request from its meta_info: `input_tokens` the prompt tokens
    computed, `cache_read_input_tokens` those served from the prefix cache (their sum is
    the prompt)."""
    cached = meta.get("cached_tokens", 0)
    return {"input_tokens": meta["prompt_tokens"] - cached, "output_tokens": meta["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_object(mid: str, model: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                   used: dict[str, int]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": used}


def event(kind: str, fields: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic's stream writes it (its type named twice)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


class BlockStream:
    """Turns the deltas of a streamed chat answer (`DeltaState.delta`: reasoning, content,
    tool-call pieces) into content-block events: a block starts when its kind of delta
    first arrives and stops when another kind does (or at `finish`), so blocks are
    consecutive and indexed in order, as in the message object."""

    def __init__(self) -> None:
        self.index = -1
        self.open: tuple[str, int] | None = None  # ("thinking" | "text" | "tool_use", call index)
        self.events: list[bytes] = []

    def feed(self, body: dict[str, Any]) -> list[bytes]:
        if body.get("reasoning_content"):
            self._delta(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""},
                        {"type": "thinking_delta", "thinking": body["reasoning_content"]})
        if body.get("content"):
            self._delta(("text", 0), {"type": "text", "text": ""}, {"type": "text_delta", "text": body["content"]})
        for piece in body.get("tool_calls") or ():
            fn = piece.get("function") or {}
            start = None
            if "id" in piece:
                start = {"type": "tool_use", "id": tool_use_id(piece["id"]), "name": fn.get("name"), "input": {}}
            self._delta(("tool_use", piece["index"]), start,
                        {"type": "input_json_delta", "partial_json": fn.get("arguments") or ""})
        events, self.events = self.events, []
        return events

    def finish(self) -> list[bytes]:
        self._stop()
        events, self.events = self.events, []
        return events

    def _delta(self, kind: tuple[str, int], start: dict[str, Any] | None, delta: dict[str, Any]) -> None:
        if kind != self.open:
            self._stop()
            self.index += 1
            self.open = kind
            block = start if start is not None else {"type": kind[0]}
            self.events.append(event("content_block_start", {"index": self.index, "content_block": block}))
        if delta.get("partial_json", delta.get("text", delta.get("thinking"))) != "":
            self.events.append(event("content_block_delta", {"index": self.index, "delta": delta}))

    def _stop(self) -> None:
        if self.open is not None:
            if self.open[0] == "thinking":  # the end of a thinking block carries its (empty) signature
                self.events.append(event("content_block_delta", {
                    "index": self.index, "delta": {"type": "signature_delta", "signature": ""}}))
            self.events.append(event("content_block_stop", {"index": self.index}))
            self.open = None
