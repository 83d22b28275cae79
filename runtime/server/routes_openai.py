"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.request_contract import LogprobOptions, TokenizedRequest
from sprig.runtime.scheduler.grammar import GRAMMAR_ERROR
from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.constraints import Constraint, request_constraint
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import (
    SSE_DONE,
    ServerState,
    SSEResponse,
    client_gone,
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
    sampling_dict,
    usage,
)
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sprig.runtime.server.reasoning import REASONING_FORMATS, Phase
from sprig.runtime.server.refused_fields import CHAT, COMPLETIONS, check_refused
from sprig.runtime.server.request_manager import Call, RequestFailed
from sprig.runtime.server.tool_calls import plan_tool_use

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


def _sampling(st: ServerState, req: CompletionRequest | ChatCompletionRequest, constraint: Constraint | None,
              prompt_len: int, max_tokens: int | None, **extra: Any) -> dict[str, Any]:
    """The sampling parameters of one prompt, for the request contract to check. `extra`:
    parameters of the server's own (a forced tool call's regex, the reasoning markers)."""
    max_new = st.builder.room(prompt_len) if max_tokens is None else max_tokens
    d = sampling_dict(req, max_new, constraint)
    d.update({k: v for k, v in extra.items() if v is not None})
    return d


def _requests(st: ServerState, prompts: list[list[int]], sampling: list[dict[str, Any]], logprobs: LogprobOptions,
              stream: bool, constraint: Constraint | None) -> list[TokenizedRequest]:
    """The request contract over OpenAI prompts; an invalid constraint is a 400 naming
    the field it came from."""
    try:
        return st.builder.requests(prompts, sampling, None, logprobs, stream=stream, prompt_field="prompt")
    except ApiError as e:
        if constraint is None or constraint.key not in e.message:
            raise
        raise ApiError(400, f"{constraint.field}: {e.message}", constraint.param) from None


def _card(st: ServerState) -> dict[str, Any]:
    return {"id": st.model_name, "object": "model", "created": now_s(), "owned_by": "sprig",
            "root": st.model_name, "max_model_len": st.model_info["context_len"]}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [_card(state_of(request))]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    st = state_of(request)
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
        _, prompts = st.builder.prompts(None if is_ids else p, p if is_ids else None, param="prompt")
        constraint = request_constraint(req)
        sampling = [_sampling(st, req, constraint, len(ids), req.max_tokens) for ids in prompts]
        want = req.logprobs is not None
        logprobs = LogprobOptions(want, 0 if want and req.echo else -1, req.logprobs or 0, True)
        reqs = _requests(st, prompts, sampling, logprobs, req.stream, constraint)
        texts = [st.builder.tokenizer.decode(ids) for ids in prompts] if is_ids else ([p] if isinstance(p, str) else p)
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

    if req.stream:
        return _stream(call, env, choice, req, constraint)
    outs = await _collect(call, request, constraint)
    choices = [c for i, r in enumerate(outs) for c in choice(i, Piece.of_response(r))]
    return json_response(env.wrap(choices=choices, usage=usage(outs, req.n)))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[ChatCompletionRequest, AnswerFormat, list[TokenizedRequest], Constraint | None]:
        check_refused(body, CHAT)
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        constraint = request_constraint(req)
        tools = plan_tool_use(req.tools, req.tool_choice, st.tool_format, constraint,
                              several=req.parallel_tool_calls is not False, context_free=st.context_free)
        text = st.builder.chat_text(req.messages, tools.rendered, _template_variables(st, req),
                                   **_continuation(req))
        ids = st.builder.encode(text, add_special_tokens=False, param="messages")
        reasoning = REASONING_FORMATS.get(st.config.reasoning_parser or "")
        phase = reasoning.phase(text) if reasoning is not None else Phase.ANSWER
        fmt = AnswerFormat(reasoning if req.separate_reasoning else None, phase, tools.parse_format, tools.names,
                           forced=tools.forced, one_call=req.parallel_tool_calls is False,
                           gated=tools.trigger is not None and (reasoning is None or req.separate_reasoning))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        extra = reasoning.sampling(phase) if reasoning is not None else {}
        own = constraint if tools.regex is None else None  # else the tools' grammar holds it
        sampling = [_sampling(st, req, own, len(ids), max_tokens, **tools.grammar_params(st.context_free), **extra)]
        logprobs = LogprobOptions(req.logprobs, -1, req.top_logprobs or 0, True)
        return req, fmt, _requests(st, [ids], sampling, logprobs, req.stream, constraint), constraint

    req, fmt, reqs, constraint = await prepare(request, build)
    call = st.manager.submit(reqs, client_of(request))
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

    if req.stream:
        return _stream(call, _Envelope(env.id, "chat.completion.chunk", env.created, env.model), delta, req,
                       constraint)
    outs = await _collect(call, request, constraint)
    choices = []
    for i, r in enumerate(outs):
        reason, matched = finish_reason(r["meta_info"]["finish_reason"])
        message, called = fmt.message(r["text"])
        lp = chat_logprobs(*Piece.of_response(r).entries(with_input=False)) if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if called else reason, "matched_stop": matched})
    return json_response(env.wrap(choices=choices, usage=usage(outs, req.n)))


def _continuation(req: ChatCompletionRequest) -> dict[str, bool]:
    """How the conversation ends: a generation prompt (the default), or, with
    `continue_final_message`, the last message left open (vLLM's and SGLang's meaning)."""
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       "continue_final_message")
    cont = req.continue_final_message
    return {"add_generation_prompt": req.add_generation_prompt and not cont, "continue_final": cont}


def _template_variables(st: ServerState, req: ChatCompletionRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs`, plus `reasoning_effort` for a template that reads it (a
    400 for one that does not: the field would change nothing)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    if st.builder.chat is None or "reasoning_effort" not in st.builder.chat.free_variables:
        raise ApiError(400, "reasoning_effort: this model's chat template takes no reasoning effort",
                       "reasoning_effort")
    return {**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}


async def _collect(call: Call, request: Request, constraint: Constraint | None) -> list[dict[str, Any]]:
    try:
        return await call.collect(functools.partial(client_gone, request))
    except RequestFailed as e:
        raise _named(e, constraint) from None


def _named(e: RequestFailed, constraint: Constraint | None) -> RequestFailed | ApiError:
    """A constraint the scheduler could not compile, as a 400 naming the field it came from."""
    if constraint is None or e.status != 400 or not e.message.startswith(GRAMMAR_ERROR):
        return e
    return ApiError(400, f"{constraint.field}: {e.message}", constraint.param)


def _stream(call: Call, env: _Envelope, choices: ChoiceFn, req: CompletionRequest | ChatCompletionRequest,
            constraint: Constraint | None) -> Response:
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    async def events() -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}
        try:
            async for update in call.stream():
                for c in choices(update.index, Piece.of_outputs(update.outputs)):
                    yield sse(env.wrap(choices=[c], **extra))
            if include_usage:
                yield sse(env.wrap(choices=[], usage=usage(call.responses(), req.n)))
        except RequestFailed as e:
            yield error_event(_named(e, constraint))
        yield SSE_DONE

    return SSEResponse(events(), call.close)
