"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.sampling import SamplingParams
from sprig.runtime.server.app import (
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
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.inputs import LogprobArgs
from sprig.runtime.server.messages import GenerateReq
from sprig.runtime.server.openai_format import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    sampling_dict,
    token_entries,
    usage,
)
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sprig.runtime.server.tokenizer_manager import Call, RequestFailed
from sprig.runtime.server.tool_calls import ToolCall, ToolUse, plan_tool_use

router = APIRouter()
ChoiceFn = Callable[[int, dict[str, Any]], list[dict[str, Any]]]


@dataclass(frozen=True)
class _Envelope:
    """The fields every response object and stream chunk of one call shares."""

    id: str
    object: str
    created: int
    model: str

    def wrap(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}


def _params(st: ServerState, req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
            max_tokens: int | None, regex: str | None = None) -> SamplingParams:
    """`regex`: a constraint of the server's own (a forced tool call)."""
    max_new = st.inputs.room(prompt_len) if max_tokens is None else max_tokens
    d = sampling_dict(req, max_new)
    if regex is not None:
        d["regex"] = regex
    return st.inputs.params(d, 1)[0]


@router.get("/v1/models")
async def models(request: Request) -> Response:
    st = state_of(request)
    card = {
        "id": st.model_name, "object": "model", "created": now_s(), "owned_by": "sprig",
        "root": st.model_name, "max_model_len": st.model_info["context_len"],
    }
    return json_response({"object": "list", "data": [card]})


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[CompletionRequest, list[str], list[GenerateReq]]:
        req: CompletionRequest = parse(CompletionRequest, body)
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        p = req.prompt
        is_ids = isinstance(p, list) and bool(p) and not isinstance(p[0], str)
        _, prompts = st.inputs.prompts(None if is_ids else p, p if is_ids else None, param="prompt")
        texts = [st.inputs.tokenizer.decode(ids) for ids in prompts] if is_ids else ([p] if isinstance(p, str) else p)
        params = [_params(st, req, len(ids), req.max_tokens) for ids in prompts]
        want = req.logprobs is not None
        logprobs = LogprobArgs(want, 0 if want and req.echo else -1, req.logprobs or 0, True)
        return req, texts, st.inputs.requests(prompts, params, None, logprobs, stream=req.stream)

    req, texts, reqs = await prepare(request, build)
    want = req.logprobs is not None
    call = st.manager.submit(reqs, client_of(request))
    env = _Envelope(f"cmpl-{uuid.uuid4().hex}", "text_completion", now_s(), st.model_name)
    sent: dict[int, tuple[int, int, int, bool]] = {}  # index -> chars, logprobs, offset, echoed input

    def choice(index: int, resp: dict[str, Any]) -> list[dict[str, Any]]:
        first = index not in sent
        chars, lps, offset, echoed = sent.get(index, (0, 0, 0, False))
        meta, prompt_text = resp["meta_info"], texts[index // req.n]
        delta = resp["text"][chars:]
        if first and req.echo:
            delta = prompt_text + delta
        elif first:
            offset = len(prompt_text)
        lp = None
        if want:
            echo_input = req.echo and not echoed and bool(meta.get("input_token_logprobs"))
            entries, tops = token_entries(meta, lps, with_input=echo_input)
            lp = completion_logprobs(entries, tops, offset)
            offset += sum(len(t) for t in lp["tokens"])
            lps, echoed = len(meta["output_token_logprobs"]), echoed or echo_input
        sent[index] = (len(resp["text"]), lps, offset, echoed)
        reason, matched = finish_reason(resp)
        if not delta and reason is None and not (lp and lp["tokens"]):
            return []
        return [{"index": index, "text": delta, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}]

    if req.stream:
        return _stream(call, env, choice, req)
    outs = await call.collect(functools.partial(client_gone, request))
    choices = [c for i, r in enumerate(outs) for c in choice(i, r)]
    return json_response(env.wrap(choices=choices, usage=usage(outs, req.n)))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[ChatCompletionRequest, ToolUse, list[GenerateReq]]:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        constrained = req.regex is not None or req.json_schema is not None or (
            req.response_format is not None and req.response_format.type != "text")
        tools = plan_tool_use(req.tools, req.tool_choice, st.tool_format, constrained)
        ids = st.inputs.chat_prompt(req.messages, tools.rendered, req.chat_template_kwargs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = [_params(st, req, len(ids), max_tokens, regex=tools.forced)]
        logprobs = LogprobArgs(req.logprobs, -1, req.top_logprobs or 0, True)
        return req, tools, st.inputs.requests([ids], params, None, logprobs, stream=req.stream)

    req, tools, reqs = await prepare(request, build)
    call = st.manager.submit(reqs, client_of(request))
    env = _Envelope(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", now_s(), st.model_name)
    fmt = tools.parse_format
    sent: dict[int, tuple[int, int]] = {}  # index -> (content chars, output logprobs)

    def answer(resp: dict[str, Any], finished: bool) -> tuple[str, list[ToolCall]]:
        return fmt.split(resp["text"], finished) if fmt is not None else (resp["text"], [])

    def delta(index: int, resp: dict[str, Any]) -> list[dict[str, Any]]:
        chars, lps = sent.get(index, (0, 0))
        out = [] if index in sent else [{"index": index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]
        reason, matched = finish_reason(resp)
        content, calls = answer(resp, reason is not None)
        sent[index] = (len(content), len(resp["meta_info"].get("output_token_logprobs", [])))
        text = content[chars:]
        lp = chat_logprobs(*token_entries(resp["meta_info"], lps, with_input=False)) if req.logprobs else None
        body: dict[str, Any] = {"content": text} if text else {}
        if calls:
            body["tool_calls"] = [c.openai(i) for i, c in enumerate(calls)]
            reason = "tool_calls"
        if body or reason is not None or (lp and lp["content"]):
            out.append({"index": index, "delta": body, "logprobs": lp, "finish_reason": reason,
                        "matched_stop": matched})
        return out

    if req.stream:
        return _stream(call, _Envelope(env.id, "chat.completion.chunk", env.created, env.model), delta, req)
    outs = await call.collect(functools.partial(client_gone, request))
    choices = []
    for i, r in enumerate(outs):
        reason, matched = finish_reason(r)
        content, calls = answer(r, True)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
            reason = "tool_calls"
        lp = chat_logprobs(*token_entries(r["meta_info"], 0, with_input=False)) if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason,
                        "matched_stop": matched})
    return json_response(env.wrap(choices=choices, usage=usage(outs, req.n)))


def _stream(call: Call, env: _Envelope, choices: ChoiceFn, req: CompletionRequest | ChatCompletionRequest) -> Response:
    include_usage = req.stream_options is not None and req.stream_options.include_usage

    async def events() -> AsyncIterator[bytes]:
        last: dict[int, dict[str, Any]] = {}
        extra = {"usage": None} if include_usage else {}
        try:
            async for index, resp in call.stream():
                last[index] = resp
                for c in choices(index, resp):
                    yield sse(env.wrap(choices=[c], **extra))
            if include_usage:
                yield sse(env.wrap(choices=[], usage=usage([last[i] for i in sorted(last)], req.n)))
        except RequestFailed as e:
            yield error_event(e)
        yield SSE_DONE

    return SSEResponse(events(), call.close)
