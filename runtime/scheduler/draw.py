"""Drawing a step's tokens: the sampler over a batch of logits rows, with each request's
penalties, grammar mask, seed and logprob options."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.runtime.sampling import SamplingBatch, sample
from sprig.runtime.sampling.logprobs import picked_logprobs
from sprig.runtime.scheduler.grammar import Grammars
from sprig.runtime.scheduler.request import Req


@dataclass(frozen=True)
class Drawn:
    """One sampling call's tokens, their raw logprobs and top logprobs, per row, and the
    raw logprobs of each row's request's `token_ids_logprob` (None when no row's request
    asked for any; else empty for those that did not)."""

    ids: list[int]
    logprobs: list[float]
    top: tuple[list[list[float]], list[list[int]]] | None
    top_n: list[int]
    picked: list[list[float]] | None


def draw_tokens(
    reqs: list[Req],
    logits: torch.Tensor,  # [R, V]
    outputs: list[list[int]],
    eos_ids: tuple[int, ...],
    grammars: Grammars,
    generator: torch.Generator | None,
    bitmasks: list[torch.Tensor | None] | None = None,
) -> Drawn:
    """Row b of `logits` sampled for `reqs[b]` as if it had generated `outputs[b]` so far
    (penalties and the min-new-tokens ban see those outputs; a seeded draw its position;
    a constrained row the grammar mask `bitmasks[b]`, where given, else its grammar's)."""
    batch = SamplingBatch.build(
        [r.params for r in reqs],
        output_ids=outputs,
        prompt_ids=[r.prompt_ids for r in reqs] if any(r.params.repetition_penalty != 1.0 for r in reqs) else None,
        eos_ids=eos_ids,
        vocab_size=logits.shape[-1],
        device=logits.device,
    )
    top_n = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
    logits = grammars.mask(reqs, logits, bitmasks)
    wanted = any(r.return_logprob for r in reqs)
    out = sample(logits, batch, top_logprobs_num=top_n, logprobs=wanted, generator=generator)
    logprobs = out.logprobs.tolist() if out.logprobs is not None else []
    top = (out.top_logprobs.values.tolist(), out.top_logprobs.ids.tolist()) if out.top_logprobs else None
    asked = [r.token_ids_logprob if r.return_logprob else () for r in reqs] if wanted else []
    picked = picked_logprobs(logits, asked) if any(asked) else None
    return Drawn(out.next_ids.tolist(), logprobs, top, top_n, picked)
