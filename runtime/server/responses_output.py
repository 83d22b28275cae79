"""A response of the Responses API from a chat answer: output items (`reasoning`, a
`message` of `output_text`, `function_call`s, in that order), the response object, and
the stream's events, made from the chat deltas `DeltaState` writes (`OutputStream`).

Invariants of a stream: every event carries a `sequence_number` one above the last; an
item is announced (`response.output_item.added`) before its deltas and closed
(`response.output_item.done`, holding the whole item) before the next one opens; the
items closed are those of the final response, in its order, with the same text (ids
included), since both are built here from the same deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from sprig.runtime.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(rid: str, created: int, model: str, req: ResponsesRequest, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, finish: str | None, stored: bool,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object: `finish` None while in progress, "length" when the output was
    cut at `max_output_tokens` (status "incomplete"), else "completed" (or "failed" with
    an `error`); `stored`: whether the server keeps it (its `store`)."""
    if error is not None:
        status = "failed"
    elif finish is None:
        status = "in_progress"
    else:
        status = "incomplete" if finish == "length" else "completed"
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": stored, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs,
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def response_usage(meta: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The Responses usage of one sequence's `meta_info`."""
    prompt, output = meta["prompt_tokens"], meta["completion_tokens"]
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output}


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The output items of a finished chat answer (`AnswerFormat.message`)."""
    stream = OutputStream(logprobs is not None)
    stream.feed({k: message[k] for k in ("reasoning_content", "content") if message.get(k)}, logprobs or [])
    for i, call in enumerate(message.get("tool_calls") or ()):
        stream.feed({"tool_calls": [{"index": i, **call}]}, [])
    stream.finish()
    return stream.items


@dataclass
class OutputStream:
    """The output items of one answer as its chat deltas arrive (`feed`), and the events
    that announce them (`events`, drained by the caller). One item is open at a time."""

    logprobs: bool
    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    open_kind: str | None = None  # "reasoning", "message" or "function_call"
    text: str = ""  # of the open item
    item_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> None:
        """Take one chat delta (`reasoning_content`, `content`, `tool_calls` pieces) and
        the logprobs of its tokens."""
        if delta.get("reasoning_content"):
            self._append("reasoning", delta["reasoning_content"], [])
        if delta.get("content"):
            self._append("message", delta["content"], logprobs)
        for piece in delta.get("tool_calls") or ():
            fn = piece.get("function") or {}
            if "id" in piece:
                self._close()
                self._open("function_call", {"type": "function_call", "id": new_id("fc"), "call_id": piece["id"],
                                             "name": fn["name"], "arguments": "", "status": "in_progress"})
            if fn.get("arguments"):
                self._append("function_call", fn["arguments"], [])

    def finish(self) -> None:
        """Close the open item."""
        self._close()

    def _open(self, kind: str, item: dict[str, Any]) -> None:
        self.items.append(item)
        self.open_kind, self.text, self.item_logprobs = kind, "", []
        self._event("response.output_item.added", item=dict(item))
        if kind == "message":
            self._event("response.content_part.added", item_id=item["id"], content_index=0,
                        part=self._part(""))

    def _append(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> None:
        if self.open_kind != kind:
            self._close()
            if kind == "reasoning":
                self._open(kind, {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress"})
            else:
                self._open(kind, {"type": "message", "id": new_id("msg"), "role": "assistant", "content": [],
                                  "status": "in_progress"})
        self.text += text
        item = self.items[-1]
        if kind == "function_call":
            self._event("response.function_call_arguments.delta", item_id=item["id"], delta=text)
        elif kind == "reasoning":
            self._event("response.reasoning_text.delta", item_id=item["id"], content_index=0, delta=text)
        else:
            self.item_logprobs += logprobs
            self._event("response.output_text.delta", item_id=item["id"], content_index=0, delta=text,
                        logprobs=logprobs)

    def _close(self) -> None:
        if self.open_kind is None:
            return
        item, text = self.items[-1], self.text
        item["status"] = "completed"
        if self.open_kind == "function_call":
            item["arguments"] = text
            self._event("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                        arguments=text)
        elif self.open_kind == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            self._event("response.reasoning_text.done", item_id=item["id"], content_index=0, text=text)
        else:
            part = self._part(text)
            item["content"] = [part]
            self._event("response.output_text.done", item_id=item["id"], content_index=0, text=text,
                        logprobs=part.get("logprobs", []))
            self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)
        self._event("response.output_item.done", item=item)
        self.open_kind = None

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs:
            part["logprobs"] = list(self.item_logprobs)
        return part

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, {"output_index": len(self.items) - 1, **fields}))


@dataclass
class EventWriter:
    """Server-sent events of one response stream, numbered from 0."""

    sequence: int = 0

    def write(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
