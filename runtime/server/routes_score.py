"""SGLang's `POST /v1/score`: label scores of a query and its items
(`sprig.runtime.label_scores`), one greedy token per item, run as one call.

The response is SGLang's, `{"scores", "model", "usage", "object": "scoring"}`: `scores[i][j]`
is label j's score after item i. Before anything is tokenized, a call is refused (400,
naming `items`) with more items than the server holds sequences in flight, or with more
text to tokenize than a request body may carry: each item is tokenized with the query
joined to it, so a long text query repeats for every item (send it as token ids then).
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.label_scores import SCORE_SAMPLING, ScoreCall, score_call
from sprig.runtime.request_contract import InvalidRequest, TokenizedRequest
from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import (
    ServerState,
    client_gone,
    client_of,
    json_response,
    prepare,
    state_of,
)
from sprig.runtime.server.protocol import ScoringRequest

router = APIRouter()


@router.post("/v1/score")
async def score(request: Request) -> Response:
    st = state_of(request)
    call, reqs = await prepare(request, lambda body: _build(st, parse(ScoringRequest, body)))
    outs = await st.manager.submit(reqs, client_of(request)).collect(functools.partial(client_gone, request))
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
             "prompt_tokens_details": {"cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs)}}
    return json_response({"scores": call.scores(outs), "model": st.model_name, "usage": usage, "object": "scoring"})


def _build(st: ServerState, req: ScoringRequest) -> tuple[ScoreCall, list[TokenizedRequest]]:
    items = [req.items] if isinstance(req.items, str) else req.items
    if items is not None and len(items) > st.manager.max_inflight:
        raise ApiError(400, f"items has {len(items)} entries; the server holds at most {st.manager.max_inflight} "
                            "sequences in flight", "items")
    if isinstance(req.query, str) and items and isinstance(items[0], str):
        text_bytes = len(items) * len(req.query.encode()) + sum(len(i.encode()) for i in items)
        if text_bytes > st.config.max_request_bytes:
            raise ApiError(400, f"query joined to each item makes {text_bytes} bytes of text to tokenize; at most "
                                f"{st.config.max_request_bytes} (send the query as token ids, or fewer items)",
                           "items")
    try:
        call = score_call(req.query, items, req.label_token_ids, req.apply_softmax, req.item_first,
                          limits=st.builder.limits, encode=lambda text: st.builder.encode(text, param="items"))
    except InvalidRequest as e:
        raise ApiError(400, str(e), e.field) from None
    reqs = st.builder.requests(call.prompts, SCORE_SAMPLING, None, call.logprobs, stream=False, prompt_field="items")
    return call, reqs
