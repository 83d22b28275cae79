"""Measure `PassCosts` when the engine starts: forward passes of the target (and of the
draft model) at two sizes each, over a context of typical length.

It runs before the scheduler admits any request: every slot of the pool is free, and the
passes write their garbage K/V into the first usable slots, one context per request
(distinct slots, as real requests have), which later requests overwrite before they
read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.speculative.cost import Line, PassCosts, Plane, line_through
from sprig.runtime.speculative.timing import timed_ms

if TYPE_CHECKING:
    from sprig.runtime.model_runner import ModelRunner
    from sprig.runtime.speculative.draft_model import DraftModel

CONTEXT = 160  # tokens each calibration request attends to
MAX_BATCH = 32  # the larger size measured (when the scheduler runs that many)


def calibration_step(batch: int, new_tokens: int, context: int, first_slot: int) -> ForwardStep:
    """`batch` requests of `new_tokens` new tokens each at the end of a `context`-token
    context, request b's context at slots `first_slot + b * context ...`."""
    return ForwardStep(
        mode=ForwardMode.DECODE if new_tokens == 1 else ForwardMode.EXTEND,
        input_ids=[0] * (batch * new_tokens),
        q_lens=[new_tokens] * batch,
        kv_lens=[context] * batch,
        kv_indices=torch.arange(first_slot, first_slot + batch * context, dtype=torch.int64),
        logits_from=[0] * batch,
    )


def calibrate(target: ModelRunner, draft: DraftModel | None, max_batch: int, drafts: int) -> PassCosts:
    """Median times of passes at 1 and B requests: target decode, target verification (of
    `drafts` drafts at 1 and B requests, of one at B), a draft model's decode step (in a
    round of `drafts`: `DraftModel.step_ms`) (B = `min(max_batch, MAX_BATCH)`, at least 2,
    and fewer where the pool holds fewer contexts). Needs an idle pool (see the module)."""
    slots = target.num_slots
    per = max(1, min(drafts + 1, slots // 2))
    big = max(2, min(max_batch, MAX_BATCH, slots // (2 * per)))
    context = max(per, min(CONTEXT, slots // big, target.model_config.context_len - 1))
    first = target.kv_cache.page_size  # the first usable slot (page 0 is padding)

    def ms(runner: ModelRunner, batch: int, new_tokens: int) -> float:
        step = calibration_step(batch, new_tokens, context, first)
        return timed_ms(lambda: runner.forward(step))

    decode = line_through(1, ms(target, 1, 1), big, ms(target, big, 1))
    verify = plane_through(big, per, ms(target, 1, per), ms(target, big, min(2, per)), ms(target, big, per))
    draft_line = (Line(0.0, 0.0) if draft is None else
                  line_through(1, draft.step_ms(1, context, first, per), big, draft.step_ms(big, context, first, per)))
    return PassCosts(decode, verify, draft_line)


def plane_through(big: int, per: int, one: float, big_short: float, big_long: float) -> Plane:
    """The verification costs through three passes: 1 request of `per` tokens (`one` ms),
    `big` requests of 2 tokens each (`big_short`) and of `per` each (`big_long`); terms
    kept non-negative."""
    short = min(2, per)
    per_token = max(0.0, (big_long - big_short) / (big * (per - short))) if per > short else 0.0
    per_request = max(0.0, (big_short - one - per_token * (big * short - per)) / (big - 1))
    return Plane(max(0.0, one - per_request - per_token * per), per_request, per_token)
