"""Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as content-block
events) and `POST /v1/messages/count_tokens`, so clients built on Anthropic's SDK (coding
agents among them) run on a local model. A message is generated as the chat completion
of the same conversation (`messages_protocol.to_chat`, `chat_call`) and written back as
content blocks (`messages_output`). Errors on these routes are Anthropic's shape
(`errors.anthropic_error_body`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.server import thinking_budget
from sprig.runtime.server.chat_answer import DeltaState
from sprig.runtime.server.chat_call import ChatCall, chat_call, collect, named
from sprig.runtime.server.errors import ApiError, anthropic_error_body, parse
from sprig.runtime.server.http_io import (
    ServerState,
    SSEResponse,
    client_of,
    json_response,
    prepare,
    state_of,
)
from sprig.runtime.server.messages_output import (
    BlockStream,
    content_blocks,
    event,
    message_object,
    new_id,
    stop_reason,
    usage,
)
from sprig.runtime.server.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    renamed,
    to_chat,
)
from sprig.runtime.server.openai_format import Piece
from sprig.runtime.server.request_manager import RequestFailed, Update

router = APIRouter()
MESSAGES_PREFIX = "/v1/messages"  # the paths whose errors are Anthropic's shape


def _chat(st: ServerState, req: MessagesRequest) -> ChatCall:
    try:
        return chat_call(st, to_chat(req, budgets=thinking_budget.enforced(st)))
    except ApiError as e:
        raise renamed(e) from None


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[MessagesRequest, ChatCall]:
        req: MessagesRequest = parse(MessagesRequest, body)
        return req, _chat(st, req)

    req, chat = await prepare(request, build)
    call = st.manager.submit(chat.requests, client_of(request))
    model = req.model or st.model_name
    if req.stream:
        return SSEResponse(_events(req, chat, model, call.stream(), call.responses), call.close)
    try:
        out = (await collect(call, request, chat.constraint))[0]
    except ApiError as e:
        raise renamed(e) from None
    message, called = chat.fmt.message(out["text"])
    reason, sequence = stop_reason(out["meta_info"]["finish_reason"], called, req.stop_sequences)
    return json_response(message_object(new_id("msg"), model, content_blocks(message), reason, sequence,
                                        usage(out["meta_info"])))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens, as `/v1/messages` would render and tokenize it."""
    st = state_of(request)

    def build(body: Any) -> int:
        req: CountTokensRequest = parse(CountTokensRequest, body)
        return len(_chat(st, req).requests[0].prompt_ids)

    return json_response({"input_tokens": await prepare(request, build, new_work=False)})


async def _events(req: MessagesRequest, chat: ChatCall, model: str, updates: AsyncIterator[Update],
                  responses: Callable[[], list[dict[str, Any]]]) -> AsyncIterator[bytes]:
    """`message_start` once the prompt is prefilled (its usage then splits the prompt's
    tokens into computed and cached), each content block's events as the answer is
    written (`BlockStream`), then `message_delta` (the stop reason and the whole usage)
    and `message_stop`; on an error, an `error` event."""
    mid, blocks, state = new_id("msg"), BlockStream(), DeltaState()
    finish, called, started = None, False, False
    try:
        async for update in updates:
            if not started:
                first = update.outputs[0]
                prompt = {"prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
                          "completion_tokens": 0}
                yield event("message_start", {"message": message_object(mid, model, [], None, None, usage(prompt))})
                started = True
            piece = Piece.of_outputs(update.outputs)
            body, called = state.delta(chat.fmt, piece.text, piece.finish is not None)
            for chunk in blocks.feed(body):
                yield chunk
            finish = piece.finish or finish
        for chunk in blocks.finish():
            yield chunk
        meta = responses()[0]["meta_info"]
        reason, sequence = stop_reason(finish or meta["finish_reason"], called, req.stop_sequences)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(meta)})
        yield event("message_stop", {})
    except RequestFailed as e:
        error = named(e, chat.constraint)
        if isinstance(error, ApiError):
            error = renamed(error)
        yield event("error", anthropic_error_body(error.status, error.message))
