"""SGLang's native routes: /generate and the endpoints its frontend and operators call."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.request_contract import LogprobOptions, TokenizedRequest
from sprig.runtime.response import STREAMED_LOGPROB_KEYS
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.server import thinking_budget
from sprig.runtime.server.errors import ApiError, error_response, parse
from sprig.runtime.server.http_io import (
    SSE_DONE,
    SSEResponse,
    client_gone,
    client_of,
    error_event,
    json_response,
    prepare,
    sse,
    state_of,
)
from sprig.runtime.server.protocol import AbortRequest, GenerateRequest
from sprig.runtime.server.request_manager import Call, RequestFailed
from sprig.runtime.wire import StatsReport

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 20.0


@router.post("/generate")
async def generate(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[GenerateRequest, bool, list[TokenizedRequest]]:
        req: GenerateRequest = parse(GenerateRequest, body)
        batch, prompts, images = st.builder.image_prompts(req.text, req.input_ids, req.image_data)
        logprobs = st.builder.logprob_options(len(prompts), req.return_logprob, req.logprob_start_len,
                                              req.top_logprobs_num, req.return_text_in_logprobs,
                                              req.token_ids_logprob)
        texts = req.text if isinstance(req.text, list) else [req.text]
        sampling = thinking_budget.with_markers(
            st, req.sampling_params, prompts,
            lambda i: texts[i] if req.text is not None else st.builder.prompt_text(prompts[i], "input_ids"))
        return req, batch, st.builder.requests(prompts, sampling, req.rid, logprobs, stream=req.stream,
                                              prompt_field="text" if req.text is not None else "input_ids",
                                              priority=req.priority, lora_path=req.lora_path, images=images)

    req, batch, reqs = await prepare(request, build)
    call = st.manager.submit(reqs, client_of(request))
    many = batch or len(call.rids) > 1
    if req.stream:
        return SSEResponse(_events(call, many), call.close)
    outs = await call.collect(functools.partial(client_gone, request))
    return json_response(outs if many else outs[0])


async def _events(call: Call, many: bool) -> AsyncIterator[bytes]:
    """Responses (with "index" for a batch), then `[DONE]`. As SGLang's frontend reads
    them: `text` and `output_ids` are cumulative, while the output-side logprob lists hold
    only the tokens new in this event (`meta_info.output_token_logprobs_length` is the
    cumulative count, equal to `completion_tokens`). A sequence's event is sent when its
    text grows, and at its end: tokens that add no text yet (part of a character, or of a
    possible stop string) ride with the next event, so every event but the last brings
    text, and a frontend that pairs each piece of text with its event's logprobs (as
    SGLang's `text_async_iter` does) never has to merge events."""
    sent: dict[int, tuple[int, int]] = {}  # index -> (text length, logprob entries) sent
    try:
        async for update in call.stream():
            index, response = update.index, update.state.snapshot()
            meta = response["meta_info"]
            text_sent, entries_sent = sent.get(index, (0, 0))
            if meta["finish_reason"] is None and len(response["text"]) == text_sent:
                continue
            if many:
                response["index"] = index
            if "output_token_logprobs" in meta:
                response["meta_info"] = meta | {k: meta[k][entries_sent:] for k in STREAMED_LOGPROB_KEYS if k in meta}
            sent[index] = (len(response["text"]), len(meta.get("output_token_logprobs", ())))
            yield sse(response)
    except RequestFailed as e:
        yield error_event(e)
    yield SSE_DONE


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    req: AbortRequest = await prepare(request, lambda body: parse(AbortRequest, body), new_work=False)
    return json_response({"rid": req.rid, "aborted": state_of(request).manager.abort(req.rid, client_of(request))})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    reply = await state_of(request).manager.control("flush_cache")
    if not reply.ok:
        raise ApiError(400, "cannot flush the cache while requests hold K/V (running, or paused in place)")
    return json_response({"message": "Cache flushed."})


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    st = state_of(request)
    return json_response(
        {
            "model_path": st.manager.weights.model_path,
            "tokenizer_path": st.model_path,
            "served_model_name": st.model_name,
            "weight_version": st.manager.weights.weight_version,
            "is_generation": True,
            "chat_template": st.builder.chat.source if st.builder.chat else None,
            "bos_token": getattr(st.builder.tokenizer, "bos_token", None),
            "eos_token": getattr(st.builder.tokenizer, "eos_token", None),
            "context_len": st.model_info["context_len"],
            "vocab_size": st.model_info["vocab_size"],
            "has_image_understanding": st.builder.images is not None,  # SGLang's: requests may carry images
            "has_audio_understanding": False,
        }
    )


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> Response:
    st = state_of(request)
    manager, stats = st.manager, st.manager.stats
    server = {k: v for k, v in dataclasses.asdict(st.config).items() if k != "api_keys"}
    runner = dataclasses.asdict(st.engine.runner) | {"model_path": st.manager.weights.model_path}
    return json_response(
        {
            "model_path": st.manager.weights.model_path,
            "weight_version": st.manager.weights.weight_version,
            "served_model_name": st.model_name,
            "url": st.url,
            "server": server | {"api_keys": len(st.config.api_keys)},
            "runner": runner,
            "scheduler": dataclasses.asdict(st.engine.scheduler),
            "model": st.model_info,
            "stats": None if stats is None else dataclasses.asdict(stats),
            "internal_states": [_internal_state(st.engine.scheduler.speculative_algorithm is not None, stats)],
            "last_idle_integrity": "unchecked" if stats is None else stats.integrity,
            "healthy": manager.dead is None,
            "error": manager.dead,
            "pids": {"http": os.getpid()} | {name: p.pid for name, p in manager.children.items()},
            "ipc_dir": manager.ipc.dir,
            "uptime_s": time.monotonic() - st.started,
        }
    )


def _internal_state(speculative: bool, stats: StatsReport | None) -> dict[str, Any]:
    """SGLang's `internal_states` entry, which its benchmark scripts read: the decode
    throughput of the last stats window and, with speculation on, the tokens per request
    per verification pass since start (`avg_spec_accept_length`)."""
    state: dict[str, Any] = {"last_gen_throughput": stats.gen_throughput if stats else 0.0}
    if speculative:
        state["avg_spec_accept_length"] = stats.spec_accept_length if stats and stats.spec_accept_length else None
    return state


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy if a one-token greedy generation completes in time; 503 at once while
    generation is paused (`/pause_generation`), when the probe could only wait."""
    st = state_of(request)
    if st.manager.paused is not None:
        return error_response(503, f"generation is paused (mode {st.manager.paused!r}); "
                                   "POST /continue_generation resumes it")
    bos = getattr(st.builder.tokenizer, "bos_token_id", None)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    reqs = st.builder.requests([[bos if bos is not None else 0]], params, None, LogprobOptions(), stream=False)
    try:
        call = st.manager.submit(reqs, client_of(request))
        await asyncio.wait_for(call.collect(), HEALTH_GENERATE_TIMEOUT_S)
    except (RequestFailed, TimeoutError) as e:
        return error_response(503, f"health check generation failed: {str(e) or 'timed out'}")
    return Response(status_code=200)


@router.get("/debug/check_integrity")
async def check_integrity(request: Request) -> Response:
    """The scheduler's KV integrity check, run between two steps, with its KV counts."""
    reply = await state_of(request).manager.control("check_integrity")
    body: dict[str, Any] = {"ok": reply.ok, **reply.data}
    return json_response(body, 200 if reply.ok else 500)
