"""What the scheduler reports after each step: per request, what is new since last time."""

from __future__ import annotations

from typing import Any

from sprig.runtime.scheduler.request import Req
from sprig.runtime.wire import TokenOutput


def collect_output(req: Req, sent_ids: int, sent_input_logprobs: bool, text: str | None) -> TokenOutput:
    """What `req` has that was not reported: tokens from `sent_ids` on, their `text` if
    the scheduler decoded it, and its input logprobs unless `sent_input_logprobs`."""
    out = TokenOutput(
        rid=req.rid,
        new_ids=req.output_ids[sent_ids:],
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        jump_forward_tokens=req.jump_forward_tokens,
        spec_accept_histogram=list(req.spec_accept_histogram),
        spec_drafted=req.spec_drafted,
        retractions=req.retractions,
        finish_reason=req.finish.to_json() if req.finish else None,
        text_delta=text,
        embedding=req.embedding,
        weight_version=req.weight_version,
    )
    if req.return_logprob:
        out.output_logprobs = [list(e) for e in req.output_logprobs[sent_ids:]]
        if req.top_logprobs_num:
            out.output_top_logprobs = _rows(req.output_top_logprobs[sent_ids:])
        if req.token_ids_logprob:
            out.output_token_ids_logprobs = _rows(req.output_token_ids_logprobs[sent_ids:])
        if req.input_logprobs_done and not sent_input_logprobs and req.logprob_start_len >= 0:
            out.input_logprobs = [list(e) for e in req.input_logprobs]
            if req.top_logprobs_num:
                out.input_top_logprobs = _rows(req.input_top_logprobs)
            if req.token_ids_logprob:
                out.input_token_ids_logprobs = _rows(req.input_token_ids_logprobs)
    return out


def _rows(rows: list[Any]) -> list[Any]:
    """Per-position lists of (logprob, token_id) pairs as lists (None rows kept)."""
    return [None if row is None else [list(e) for e in row] for row in rows]
