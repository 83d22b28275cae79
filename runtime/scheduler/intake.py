"""What the scheduler checks before it queues a request: only what the model, the KV pool
and the queue decide (the request's own fields were validated where it was built)."""

from __future__ import annotations

from dataclasses import dataclass

from sprig.runtime.scheduler.request import Req


class RequestRejected(ValueError):
    """A request that can never be served as given (too long, bad ids, duplicate rid)."""


class QueueFull(RuntimeError):
    """More requests are queued than `max_queued_requests` allows."""


@dataclass(frozen=True)
class Limits:
    """The bounds a request must fit: the model's vocabulary and context, the KV pool
    (`pool_tokens` slots, handed out in pages of `page_size`) and the queue."""

    vocab_size: int
    context_len: int
    pool_tokens: int
    page_size: int
    max_queued: int


def check_request(req: Req, limits: Limits, *, known: bool, queued: int) -> None:
    """RequestRejected if `req` can never run (its rid `known` already, an empty prompt,
    ids outside the vocabulary, longer than the context or the whole pool, parameters the
    model cannot honour); QueueFull if `queued` requests already fill the queue."""
    p = req.params
    if known:
        raise RequestRejected(f"request id {req.rid!r} is already in use")
    if not req.prompt_ids:
        raise RequestRejected("the prompt is empty")
    if bad := [t for t in req.prompt_ids if not 0 <= t < limits.vocab_size]:
        raise RequestRejected(f"input_ids contain token ids outside [0, {limits.vocab_size}): {bad[:5]}")
    total = len(req.prompt_ids) + p.max_new_tokens
    if total > limits.context_len:
        raise RequestRejected(
            f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} "
            f"exceeds the model's context length {limits.context_len}"
        )
    if -(-total // limits.page_size) * limits.page_size > limits.pool_tokens:
        raise RequestRejected(
            f"prompt + max_new_tokens = {total} tokens exceeds the KV pool ({limits.pool_tokens} tokens)"
        )
    try:
        p.validate_for_model(limits.vocab_size)
    except ValueError as e:
        raise RequestRejected(str(e)) from None
    if req.top_logprobs_num < 0:
        raise RequestRejected(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")
    if queued >= limits.max_queued:
        raise QueueFull(f"{queued} requests are queued (max_queued_requests); retry later")
