"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.request_contract import LogprobOptions, TokenizedRequest
from sprig.runtime.server import thinking_budget
from sprig.runtime.server.chat_answer import DeltaState
from sprig.runtime.server.chat_call import (
    ChatCall,
    adapter_of,
    chat_call,
    collect,
    contract_requests,
    named,
    reasoning_tokens,
    sampling_for,
)
from sprig.runtime.server.constraints import Constraint, request_constraint
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import (
    SSE_DONE,
    ServerState,
    SSEResponse,
    client_of,
    error_event,
    json_response,
    now_s,
    prepare,
    sse,
    state_of,
)
from sprig.runtime.server.openai_format import (
    Piece,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage,
)
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sprig.runtime.server.refused_fields import CHAT, COMPLETIONS, check_refused
from sprig.runtime.server.request_manager import Call, RequestFailed

router = APIRouter()
ChoiceFn = Callable[[int, Piece], list[dict[str, Any]]]


@dataclass(frozen=True)
class _Envelope:
    """The fields every response object and stream chunk of one call shares."""

    id: str
    object: str
    created: int
    model: str

    def wrap(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}


def _card(st: ServerState, adapter: str | None = None) -> dict[str, Any]:
    """The served model's card, or a loaded LoRA adapter's (vLLM's: its path as `root`,
    the served model as `parent`), with the fields of Anthropic's model object too
    (`type`, `display_name`, `created_at`), so either API's client reads it."""
    created = now_s()
    card = {"id": st.model_name, "object": "model", "created": created, "owned_by": "sprig",
            "root": st.model_name, "parent": None, "max_model_len": st.model_info["context_len"],
            "type": "model", "display_name": st.model_name,
            "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")}
    if adapter is not None:
        card |= {"id": adapter, "display_name": adapter, "root": st.manager.weights.adapters[adapter],
                 "parent": st.model_name}
    return card


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """OpenAI's list, with the paging fields of Anthropic's (everything on one page)."""
    st = state_of(request)
    cards = [_card(st), *(_card(st, a) for a in st.manager.weights.adapters)]
    return json_response({"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"],
                          "last_id": cards[-1]["id"]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    st = state_of(request)
    if model_id in st.manager.weights.adapters and model_id != st.model_name:
        return json_response(_card(st, model_id))
    if model_id != st.model_name:
        raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {st.model_name!r}", "model")
    return json_response(_card(st))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[CompletionRequest, list[str], list[TokenizedRequest], Constraint | None]:
        check_refused(body, COMPLETIONS)
        req: CompletionRequest = parse(CompletionRequest, body)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        p = req.prompt
        is_ids = isinstance(p, list) and bool(p) and not isinstance(p[0], str)
        budget, budget_field = thinking_budget.requested(req)
        fmt = None if budget is None else thinking_budget.reasoning_format(st, budget_field)
        _, prompts = st.builder.prompts(None if is_ids else p, p if is_ids else None, param="prompt")
        constraint = request_constraint(req)
        texts = None if is_ids else ([p] if isinstance(p, str) else p)
        sampling = [sampling_for(st, req, constraint, len(ids), req.max_tokens) for ids in prompts]
        if fmt is not None:
            for i, ids in enumerate(prompts):
                text = st.builder.prompt_text(ids, "prompt") if texts is None else texts[i]
                sampling[i] |= thinking_budget.budget_params(fmt, fmt.phase(text), budget)
        want = req.logprobs is not None
        logprobs = LogprobOptions(want, 0 if want and req.echo else -1, req.logprobs or 0, True)
        reqs = contract_requests(st, prompts, sampling, logprobs, req.stream, constraint, req.priority,
                                 adapter_of(st, req.model, req.lora_path))
        texts = texts or [st.builder.tokenizer.decode(ids) for ids in prompts]
        return req, texts, reqs, constraint

    req, texts, reqs, constraint = await prepare(request, build)
    want = req.logprobs is not None
    call = st.manager.submit(reqs, client_of(request))
    env = _Envelope(f"cmpl-{uuid.uuid4().hex}", "text_completion", now_s(), st.model_name)
    sent: dict[int, tuple[int, bool]] = {}  # index -> text offset, echoed input
    special = frozenset(st.builder.tokenizer.all_special_ids)

    def choice(index: int, piece: Piece) -> list[dict[str, Any]]:
        first = index not in sent
        offset, echoed = sent.get(index, (0, False))
        prompt_text = texts[index // req.n]
        delta = piece.text
        if first and req.echo:
            delta = prompt_text + delta
        elif first:
            offset = len(prompt_text)
        lp = None
        if want:
            echo_input = req.echo and not echoed and bool(piece.input)
            lp, offset = completion_logprobs(*piece.entries(with_input=echo_input), offset, delta, special)
            echoed = echoed or echo_input
        sent[index] = (offset, echoed)
        reason, matched = finish_reason(piece.finish)
        if not delta and reason is None and not (lp and lp["tokens"]):
            return []
        return [{"index": index, "text": delta, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}]

    async def usage_of(outs: list[dict[str, Any]]) -> dict[str, Any]:
        return usage(outs, req.n)

    if req.stream:
        return _stream(call, env, choice, req, usage_of, constraint)
    outs = await collect(call, request, constraint)
    choices = [c for i, r in enumerate(outs) for c in choice(i, Piece.of_response(r))]
    return json_response(env.wrap(choices=choices, usage=await usage_of(outs), metadata=_metadata(outs)))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[ChatCompletionRequest, ChatCall]:
        check_refused(body, CHAT)
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        return req, chat_call(st, req)

    req, chat = await prepare(request, build)
    fmt, constraint = chat.fmt, chat.constraint
    call = st.manager.submit(chat.requests, client_of(request))
    env = _Envelope(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", now_s(), st.model_name)
    sent: dict[int, DeltaState] = {}

    def delta(index: int, piece: Piece) -> list[dict[str, Any]]:
        out = [] if index in sent else [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]
        state = sent.setdefault(index, DeltaState())
        reason, matched = finish_reason(piece.finish)
        body, called = state.delta(fmt, piece.text, reason is not None)
        lp = chat_logprobs(*piece.entries(with_input=False)) if req.logprobs else None
        if called:
            reason = "tool_calls"
        if body or reason is not None or (lp and lp["content"]):
            out.append({"index": index, "delta": body, "logprobs": lp, "finish_reason": reason,
                        "matched_stop": matched})
        return out

    async def usage_of(outs: list[dict[str, Any]]) -> dict[str, Any]:
        return usage(outs, req.n, await reasoning_tokens(st, fmt, [r["text"] for r in outs]))

    if req.stream:
        return _stream(call, _Envelope(env.id, "chat.completion.chunk", env.created, env.model), delta, req,
                       usage_of, constraint)
    outs = await collect(call, request, constraint)
    choices = []
    for i, r in enumerate(outs):
        reason, matched = finish_reason(r["meta_info"]["finish_reason"])
        message, called = fmt.message(r["text"])
        lp = chat_logprobs(*Piece.of_response(r).entries(with_input=False)) if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if called else reason, "matched_stop": matched})
    return json_response(env.wrap(choices=choices, usage=await usage_of(outs), metadata=_metadata(outs)))


def _metadata(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's `metadata` of a whole (not streamed) response: the label of the weights its
    sequences ran on (one call's requests reach the scheduler together, so one label)."""
    return {"weight_version": outs[0]["meta_info"]["weight_version"]}


def _stream(call: Call, env: _Envelope, choices: ChoiceFn, req: CompletionRequest | ChatCompletionRequest,
            usage_of: Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]],
            constraint: Constraint | None) -> Response:
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    async def events() -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}
        try:
            async for update in call.stream():
                for c in choices(update.index, Piece.of_outputs(update.outputs)):
                    yield sse(env.wrap(choices=[c], **extra))
            if include_usage:
                yield sse(env.wrap(choices=[], usage=await usage_of(call.responses())))
        except RequestFailed as e:
            yield error_event(named(e, constraint))
        yield SSE_DONE

    return SSEResponse(events(), call.close)
