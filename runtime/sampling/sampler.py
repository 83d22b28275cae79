"""One batched sampling call per step.

Order, per row: logit_bias, the min-new-tokens ban of stop tokens, penalties (these three
also apply to greedy rows, which then take the argmax: transformers-greedy parity);
sampling rows go on through temperature, top-k, top-p on the top-k-renormalized
distribution, min-p, and an exponential race `argmax(p / E)`. E comes from
`noise.exponential_noise` for seeded rows and from the caller's generator otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.runtime.sampling.batch import Draws, Penalties, SamplingBatch, SparseLogits
from sprig.runtime.sampling.logprobs import TopLogprobs, token_logprobs
from sprig.runtime.sampling.noise import exponential_noise


@dataclass(frozen=True)
class SampleOutput:
    """The chosen tokens and their raw logprobs (see `logprobs`), None when not asked for.
    `top_logprobs` has K = max(top_logprobs_num) columns; row b's first
    `top_logprobs_num[b]` are its answer."""

    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, log_softmax(raw logits)[b, next_ids[b]]
    top_logprobs: TopLogprobs | None  # [B, K]; None when K == 0


def sample(
    logits: torch.Tensor,  # [B, V] float32, the model's raw logits; never modified
    batch: SamplingBatch,
    *,
    top_logprobs_num: list[int] | int = 0,
    logprobs: bool = True,
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """Pick one token per row. Seeded rows are reproducible whatever the batch around
    them; unseeded rows draw from `generator` (the runner's, on the logits' device).
    The chosen tokens' logprobs cost a log-softmax over the vocabulary: `logprobs=False`
    skips them unless top logprobs are asked for."""
    if logits.shape != (batch.batch_size, batch.vocab_size):
        raise ValueError(f"logits {tuple(logits.shape)} do not match the sampling batch")
    logits = logits.float()
    processed = process_logits(logits, batch)
    next_ids = processed.argmax(dim=-1)  # [B]
    if batch.draws is not None:
        rows = batch.draws.rows
        next_ids[rows] = _draw(processed.index_select(0, rows), batch.draws, generator)
    if isinstance(top_logprobs_num, int):
        top_k = top_logprobs_num
    elif len(top_logprobs_num) == batch.batch_size:
        top_k = max(top_logprobs_num, default=0)
    else:
        raise ValueError("top_logprobs_num must be an int or have one entry per row")
    if not logprobs and top_k <= 0:
        return SampleOutput(next_ids=next_ids, logprobs=None, top_logprobs=None)
    chosen, top = token_logprobs(logits, next_ids, top_k=top_k)
    return SampleOutput(next_ids=next_ids, logprobs=chosen, top_logprobs=top)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [B, V]
    """Apply logit_bias, then the ban, then penalties, to a copy of `logits`; returns
    `logits` itself when the batch has none of them."""
    if batch.logit_bias is None and batch.banned is None and batch.penalties is None:
        return logits
    out = logits.clone()
    for edits in (batch.logit_bias, batch.banned):
        if edits is not None:
            _add_sparse(out, edits)
    if batch.penalties is not None:
        _penalize(out, batch.penalties)
    return out


def _add_sparse(logits: torch.Tensor, edits: SparseLogits) -> None:
    logits.index_put_((edits.rows, edits.token_ids), edits.values, accumulate=True)


def _penalize(logits: torch.Tensor, pen: Penalties) -> None:
    rows = logits.index_select(0, pen.rows)  # [P, V]
    if pen.seen is not None:
        repeated = torch.where(rows > 0, rows / pen.repetition, rows * pen.repetition)
        rows = torch.where(pen.seen, repeated, rows)
    if pen.output_counts is not None:
        counts = pen.output_counts
        rows = rows - pen.frequency * counts - pen.presence * (counts > 0)
    logits.index_copy_(0, pen.rows, rows)


def _draw(
    logits: torch.Tensor,  # [S, V] processed logits of the sampling rows
    draws: Draws,
    generator: torch.Generator | None,
) -> torch.Tensor:  # [S] int64
    scaled = logits / draws.temperatures
    if draws.use_top_k or draws.use_top_p or draws.use_min_p:
        scaled = _filter(scaled, draws)
    return (scaled - _noise(draws, logits.shape, generator).log()).argmax(dim=-1)


def _filter(logits: torch.Tensor, draws: Draws) -> torch.Tensor:  # [S, V]
    """Set every token outside the row's top-k, nucleus or min-p set to -inf. The most
    likely token always survives."""
    ordered, order = logits.sort(dim=-1, descending=True)  # [S, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)
    keep = rank[None, :] < draws.top_ks
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = ordered.softmax(dim=-1)
    if draws.use_top_p:
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        keep &= (before < draws.top_ps) | (draws.top_ps >= 1)
    if draws.use_min_p:
        keep &= probs >= draws.min_ps * probs[:, :1]
    keep[:, 0] = True  # even when top_p rounds to 0 in float32
    mask = torch.empty_like(keep).scatter_(1, order, keep)
    return logits.masked_fill(~mask, float("-inf"))


def _noise(
    draws: Draws, shape: torch.Size, generator: torch.Generator | None
) -> torch.Tensor:  # [S, V] float32 Exp(1), > 0
    num_seeded = draws.seed_keys.numel()
    unseeded = torch.empty(
        shape[0] - num_seeded, shape[1], dtype=torch.float32, device=draws.rows.device
    )
    unseeded.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    if num_seeded == 0:
        return unseeded
    return torch.cat([unseeded, exponential_noise(draws.seed_keys, shape[1])])
