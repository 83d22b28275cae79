"""OpenAI's Responses API: `POST /v1/responses` (whole, or streamed as semantic events),
`GET` and `DELETE /v1/responses/{id}` for stored responses, and
`GET /v1/responses/{id}/input_items`. A response is generated as
the chat completion of the same conversation (`responses_protocol.to_chat`, `chat_call`)
and written back as output items (`responses_output`); stored ones (`responses_store`)
carry a conversation on through `previous_response_id`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.chat_call import ChatCall, chat_call, collect, named, reasoning_tokens
from sprig.runtime.server.errors import ApiError, error_type, parse
from sprig.runtime.server.http_io import (
    ServerState,
    SSEResponse,
    client_of,
    json_response,
    now_s,
    prepare,
    state_of,
)
from sprig.runtime.server.openai_format import Piece, chat_logprobs, finish_reason
from sprig.runtime.server.refused_fields import RESPONSES, check_refused
from sprig.runtime.server.request_manager import RequestFailed, Update
from sprig.runtime.server.responses_items import MAX_LIMIT, as_listed, item_page
from sprig.runtime.server.responses_output import (
    EventWriter,
    OutputStream,
    new_id,
    output_items,
    response_object,
    response_usage,
)
from sprig.runtime.server.responses_protocol import ResponsesRequest, input_items, renamed, to_chat
from sprig.runtime.server.responses_store import Stored

router = APIRouter()
_STORE_RULE = "responses are kept in memory, within --responses-store-bytes"
_NO_STORE = ("this server keeps no responses: --responses-store-bytes 0, which data-parallel workers run with; "
             "send the conversation as input")


@dataclass(frozen=True)
class _Job:
    """One response being made: its request, its id and time, the conversation items it
    follows (what the store keeps as its input), the chat call that makes it, and whether
    it is kept (`store`, on a server that keeps responses)."""

    req: ResponsesRequest
    rid: str
    created: int
    inputs: list[dict[str, Any]]
    chat: ChatCall
    stored: bool

    def response(self, model: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, finish: str | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.rid, self.created, model, self.req, output, usage, finish, self.stored, error)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    st = state_of(request)
    client = client_of(request)

    def build(body: Any) -> _Job:
        check_refused(body, RESPONSES)
        req: ResponsesRequest = parse(ResponsesRequest, body)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = st.responses.get(client, req.previous_response_id)
            if previous is None:
                raise ApiError(404, f"previous_response_id: no stored response {req.previous_response_id!r} "
                                    f"({_STORE_RULE if st.responses.max_bytes else _NO_STORE})",
                               "previous_response_id")
            history = previous.items
        try:
            chat = chat_call(st, to_chat(req, history))
        except ApiError as e:
            raise renamed(e) from None
        stored = req.store and st.responses.max_bytes > 0
        return _Job(req, new_id("resp"), now_s(), history + as_listed(input_items(req)), chat, stored)

    job = await prepare(request, build)
    call = st.manager.submit(job.chat.requests, client)
    if job.req.stream:
        return SSEResponse(_events(st, job, call.stream(), call.responses, client), call.close)
    try:
        out = (await collect(call, request, job.chat.constraint))[0]
    except ApiError as e:
        raise renamed(e) from None
    message, called = job.chat.fmt.message(out["text"])
    logprobs = chat_logprobs(*Piece.of_response(out).entries(with_input=False))["content"] \
        if job.req.wants_logprobs else None
    reason, _ = finish_reason(out["meta_info"]["finish_reason"])
    usage = response_usage(out["meta_info"], await reasoning_tokens(st, job.chat.fmt, [out["text"]]) or 0)
    response = job.response(st.model_name, output_items(message, logprobs), usage, "tool_calls" if called else reason)
    _keep(st, job, response, client)
    return json_response(response)


@router.get("/v1/responses/{rid}")
async def get_response(request: Request, rid: str) -> Response:
    return json_response(_stored(request, rid).response)


@router.get("/v1/responses/{rid}/input_items")
async def list_input_items(request: Request, rid: str, limit: int = Query(20, ge=1, le=MAX_LIMIT),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           before: str | None = None) -> Response:
    """The input items `rid` was generated after (`responses_items`). `include` is
    accepted and has no effect: items are listed as they were stored."""
    inputs = _stored(request, rid).inputs
    return json_response(item_page(inputs, limit=limit, order=order, after=after, before=before))


@router.delete("/v1/responses/{rid}")
async def delete_response(request: Request, rid: str) -> Response:
    if not state_of(request).responses.delete(client_of(request), rid):
        raise ApiError(404, f"no stored response {rid!r}", "response_id")
    return json_response({"id": rid, "object": "response", "deleted": True})


async def _events(st: ServerState, job: _Job, updates: AsyncIterator[Update],
                  responses: Callable[[], list[dict[str, Any]]], client: int | None) -> AsyncIterator[bytes]:
    """The stream: `response.created` and `.in_progress`, each item's events as the answer
    is written (`OutputStream`), then `response.completed` (`.incomplete` when cut at
    `max_output_tokens`) holding the whole response; on an error, an `error` event and
    `response.failed`."""
    writer, out, state = EventWriter(), OutputStream(job.req.wants_logprobs), DeltaState()
    fmt: AnswerFormat = job.chat.fmt
    started = job.response(st.model_name, [], None, None)
    yield writer.write("response.created", {"response": started})
    yield writer.write("response.in_progress", {"response": started})
    finish = None
    try:
        async for update in updates:
            piece = Piece.of_outputs(update.outputs)
            reason, _ = finish_reason(piece.finish)
            body, called = state.delta(fmt, piece.text, reason is not None)
            logprobs = chat_logprobs(*piece.entries(with_input=False))["content"] if job.req.wants_logprobs else []
            out.feed(body, logprobs)
            for kind, fields in _drain(out):
                yield writer.write(kind, fields)
            if reason is not None:
                finish = "tool_calls" if called else reason
        out.finish()
        for kind, fields in _drain(out):
            yield writer.write(kind, fields)
        last = responses()[0]
        usage = response_usage(last["meta_info"], await reasoning_tokens(st, fmt, [last["text"]]) or 0)
        response = job.response(st.model_name, out.items, usage, finish)
        _keep(st, job, response, client)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield writer.write(done, {"response": response})
    except RequestFailed as e:
        error = named(e, job.chat.constraint)
        if isinstance(error, ApiError):
            error = renamed(error)
        param = getattr(error, "param", None)
        yield writer.write("error", {"code": error_type(error.status), "message": error.message, "param": param})
        failed = job.response(st.model_name, out.items, None, None,
                              {"code": error_type(error.status), "message": error.message})
        yield writer.write("response.failed", {"response": failed})


def _stored(request: Request, rid: str) -> Stored:
    """The stored response `rid` of the request's client; a 404 when there is none."""
    stored = state_of(request).responses.get(client_of(request), rid)
    if stored is None:
        raise ApiError(404, f"no stored response {rid!r}", "response_id")
    return stored


def _drain(out: OutputStream) -> list[tuple[str, dict[str, Any]]]:
    events, out.events = out.events, []
    return events


def _keep(st: ServerState, job: _Job, response: dict[str, Any], client: int | None) -> None:
    if job.stored:
        st.responses.put(client, response, job.inputs)
