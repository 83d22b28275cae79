"""What the scheduler checks before it queues a request: only what the KV pool and the
queue decide (the request's own fields were validated where it was built)."""

from __future__ import annotations

from dataclasses import dataclass

from sprig.runtime.scheduler.request import Req


class RequestRejected(ValueError):
    """A request that can never be served here (longer than the KV pool, a duplicate rid)."""


class QueueFull(RuntimeError):
    """More requests are queued than `max_queued_requests` allows."""


@dataclass(frozen=True)
class Limits:
    """The bounds a request must fit: the model's context, the KV pool (`pool_tokens`
    slots, handed out in pages of `page_size`) and the queue."""

    context_len: int
    pool_tokens: int
    page_size: int
    max_queued: int


def check_request(req: Req, limits: Limits, *, known: bool, queued: int) -> None:
    """RequestRejected if `req` can never run here (its rid `known` already, longer than
    the whole KV pool); QueueFull if `queued` requests already fill the queue. The request's
    own fields were checked where it was built (`runtime/request_contract.py`); a request
    that breaks that contract is an internal error (AssertionError), not a rejection."""
    total = len(req.prompt_ids) + req.params.max_new_tokens
    if not (req.prompt_ids and total <= limits.context_len and req.top_logprobs_num >= 0):
        raise AssertionError(f"request {req.rid!r} was not built by the request contract")
    if known:
        raise RequestRejected(f"request id {req.rid!r} is already in use")
    if -(-total // limits.page_size) * limits.page_size > limits.pool_tokens:
        raise RequestRejected(
            f"prompt + max_new_tokens = {total} tokens exceeds the KV pool ({limits.pool_tokens} tokens)"
        )
    if queued >= limits.max_queued:
        raise QueueFull(f"{queued} requests are queued (max_queued_requests); retry later")
