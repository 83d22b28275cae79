"""Embeddings: SGLang's native `POST /encode` and OpenAI's `POST /v1/embeddings`.

Each prompt is an `embed` request (`request_contract.build_embedding_requests`): it runs
its prefill beside everything else and ends with the L2-normalized final hidden state of
its last token (`Engine.encode`). `/v1/embeddings` answers OpenAI's list object; with
`encoding_format: "base64"` (what the official client asks for) each vector is its
float32 little-endian bytes in base64; `dimensions` keeps that many leading components,
normalized again.
"""

from __future__ import annotations

import base64
import functools
import math
import sys
from array import array
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.request_contract import (
    InvalidRequest,
    TokenizedRequest,
    build_embedding_requests,
)
from sprig.runtime.server.chat_call import adapter_of
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import (
    ServerState,
    client_gone,
    client_of,
    json_response,
    prepare,
    state_of,
)
from sprig.runtime.server.protocol import EmbeddingRequest, EncodeRequest

router = APIRouter()


@router.post("/encode")
async def encode(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[bool, list[TokenizedRequest]]:
        req: EncodeRequest = parse(EncodeRequest, body)
        batch, prompts = st.builder.prompts(req.text, req.input_ids)
        return batch, _requests(st, prompts, req.rid, "text" if req.text is not None else "input_ids", req.lora_path)

    batch, reqs = await prepare(request, build)
    outs = await _collect(st, request, reqs)
    return json_response(outs if batch else outs[0])


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    st = state_of(request)

    def build(body: Any) -> tuple[EmbeddingRequest, list[TokenizedRequest]]:
        req: EmbeddingRequest = parse(EmbeddingRequest, body)
        hidden = st.model_info["hidden_size"]
        if req.dimensions is not None and req.dimensions > hidden:
            raise ApiError(400, f"dimensions must be at most the model's hidden size, {hidden}", "dimensions")
        p = req.input
        is_ids = isinstance(p, list) and bool(p) and not isinstance(p[0], str)
        _, prompts = st.builder.prompts(None if is_ids else p, p if is_ids else None, param="input")
        return req, _requests(st, prompts, None, "input", adapter_of(st, req.model, None))

    req, reqs = await prepare(request, build)
    outs = await _collect(st, request, reqs)
    data = [{"object": "embedding", "index": i, "embedding": _format(o["embedding"], req)} for i, o in enumerate(outs)]
    tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return json_response({"object": "list", "data": data, "model": st.model_name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _requests(st: ServerState, prompts: list[list[int]], rid: Any, field: str,
              lora_path: Any = None) -> list[TokenizedRequest]:
    try:
        return build_embedding_requests(prompts, st.builder.limits, rid=rid, new_rid=st.builder.new_rid,
                                        prompt_field=field, lora_path=lora_path)
    except InvalidRequest as e:
        raise ApiError(400, str(e), e.field) from None


async def _collect(st: ServerState, request: Request, reqs: list[TokenizedRequest]) -> list[dict[str, Any]]:
    return await st.manager.submit(reqs, client_of(request)).collect(functools.partial(client_gone, request))


def _format(vector: list[float], req: EmbeddingRequest) -> list[float] | str:
    if req.dimensions is not None:
        vector = vector[: req.dimensions]
        norm = math.sqrt(math.fsum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    if req.encoding_format == "base64":
        floats = array("f", vector)  # float32
        if sys.byteorder == "big":
            floats.byteswap()
        return base64.b64encode(floats.tobytes()).decode("ascii")
    return vector
