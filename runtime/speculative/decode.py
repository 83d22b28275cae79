"""The speculative decode step: draft, verify every request's drafts in one forward pass
of the target, keep what the acceptance rule accepts.

Invariants:
- Each request's tokens are exactly what the plain decode step would emit one step at a
  time: target row j of a request is sampled as if its output already held its first j
  drafts (same penalties, min-new-tokens ban and seeded noise), and `accepted_length`
  keeps drafts only while they equal those tokens.
- KV: drafts get slots only from the free list (they never evict cache or retract); a
  rejected draft's slots are freed in the same step; `kv_len` covers only accepted
  tokens, so what a request releases to the radix tree is verified. A drafter that keeps
  KV of its own at the target's slots (the draft model) sees every extend the scheduler
  runs (`mirror`) and, before any verified token is emitted, which tokens each
  verification pass keeps (`verified`).
- Constrained requests (a grammar) are not drafted for: they verify no drafts, which is
  the plain decode step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.speculative.accept import accepted_length
from sprig.runtime.speculative.calibrate import calibrate
from sprig.runtime.speculative.cost import PassCosts, Scales, draft_cap
from sprig.runtime.speculative.draft_length import START_RATE, AcceptanceRate, DraftLength
from sprig.runtime.speculative.draft_model import DraftModel
from sprig.runtime.speculative.drafter import DRAFTERS

log = logging.getLogger("sprig.scheduler")
PRIOR_DECAY = 0.9  # per verification, the weight of the past in the acceptance a new request is assumed to have
PROBE_AFTER = 64  # steps in a row without drafts or probes, after which one step asks for a draft per request

if TYPE_CHECKING:
    from sprig.radix import PrefixCache
    from sprig.runtime.model_runner import ModelRunner
    from sprig.runtime.scheduler.config import SchedulerConfig
    from sprig.runtime.scheduler.request import Req
    from sprig.runtime.scheduler.scheduler import Drawn, Scheduler


@dataclass
class SpeculativeStats:
    """Counters since start: verification passes, drafts verified, drafts accepted and
    tokens emitted by the passes (accepted drafts plus one target token per request)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    request_steps: int = 0  # (request, verification pass) pairs

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens per request per target pass (1.0: no draft ever accepted)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0


class SpeculativeDecoder:
    """Replaces the scheduler's plain decode step when speculative decoding is on."""

    def __init__(self, config: SchedulerConfig, cache: PrefixCache, runner: ModelRunner) -> None:
        self.drafter = DRAFTERS[config.speculative_algorithm](config, cache, runner)
        self.max_len = config.speculative_num_draft_tokens
        self.measured = config.speculative_pass_costs is None  # then corrected by timing the passes
        self.costs = (
            calibrate(runner, self.drafter if isinstance(self.drafter, DraftModel) else None,
                      config.max_running_requests, self.max_len) if self.measured
            else PassCosts.parse(config.speculative_pass_costs)
        )
        self.scales = Scales()
        log.info("speculative decoding with the %s drafter, at most %d drafts per request; pass costs %s "
                 "(%s: --speculative-pass-costs %s)", config.speculative_algorithm, self.max_len,
                 self.costs.describe(), "measured at startup, corrected as passes are timed" if self.measured
                 else "given", self.costs)
        self.lengths: dict[str, DraftLength] = {}
        self.prior = AcceptanceRate.starting_at(START_RATE, PRIOR_DECAY)  # over recent verifications of all requests
        self.undrafted = 0  # steps in a row that verified no drafts
        self.stats = SpeculativeStats()

    def decode(self, sched: Scheduler) -> list[Req]:
        """One verification pass over every running request (room for their pending tokens
        already reserved); returns the requests it touched."""
        batch = list(sched.running)
        self.lengths = {r.rid: self.lengths.get(r.rid) or DraftLength(self.max_len, rate=self.prior.rate) for r in batch}
        start = time.perf_counter()
        drafts = self._drafts(sched, batch)
        drafted = time.perf_counter()
        pending = [r.seq_len - r.kv_len for r in batch]
        q_lens = [n + len(d) for n, d in zip(pending, drafts, strict=True)]
        ends = [r.kv_len + q for r, q in zip(batch, q_lens, strict=True)]
        step = ForwardStep(
            mode=ForwardMode.DECODE if max(q_lens) == 1 else ForwardMode.EXTEND,
            input_ids=[t for r, d in zip(batch, drafts, strict=True) for t in r.pending_ids() + d],
            q_lens=q_lens,
            kv_lens=ends,
            kv_indices=sched.kv.contexts(batch, ends),
            logits_from=[n - 1 for n in pending],
        )
        logits = sched.runner.forward(step)  # [sum(len(d) + 1), V]
        rows = [r for r, d in zip(batch, drafts, strict=True) for _ in range(len(d) + 1)]
        outputs = [r.output_ids + d[:j] for r, d in zip(batch, drafts, strict=True) for j in range(len(d) + 1)]
        drawn = sched.draw(rows, logits, outputs)
        if self.measured:
            self._time(len(batch), drafts, drafted - start, time.perf_counter() - drafted)
        bases = [0, *accumulate(len(d) + 1 for d in drafts)][:-1]  # each request's first row
        accepted = [accepted_length(drawn.ids[b : b + len(d) + 1], d) for b, d in zip(bases, drafts, strict=True)]
        self.drafter.verified(sched.kv, batch, drafts, [n + a for n, a in zip(pending, accepted, strict=True)])
        for req, draft, a, base in zip(batch, drafts, accepted, bases, strict=True):
            self._accept(sched, req, draft, a, drawn, base)
        self.stats.verify_steps += 1
        return batch

    def _time(self, batch: int, drafts: list[list[int]], drafting_s: float, pass_s: float) -> None:
        """Correct the cost lines by what this pass took (the target's forward and the
        draw, and the draft model's steps)."""
        tokens = batch + sum(len(d) for d in drafts)
        if tokens > batch:
            self.scales.observe("verify", self.costs.verify.at(batch, tokens), pass_s * 1e3)
        else:
            self.scales.observe("decode", self.costs.decode.at(batch), pass_s * 1e3)
        if isinstance(self.drafter, DraftModel) and tokens > batch:  # its catching up on prompts is not a step
            steps = max(len(d) for d in drafts)
            live = [sum(1 for d in drafts if len(d) > j) for j in range(steps)]
            self.scales.observe("draft", sum(self.costs.draft.at(n) for n in live),
                                (drafting_s - self.drafter.extend_s) * 1e3)

    def mirror(self, step: ForwardStep) -> None:
        """The scheduler ran the extend `step` on the target."""
        self.drafter.mirror(step)

    def _drafts(self, sched: Scheduler, batch: list[Req]) -> list[list[int]]:
        """The drafts each request verifies this step, their slots reserved: as many as
        `draft_cap` finds worth their cost (none at all when the plain pass is expected
        to be as fast: a pass with drafts leaves the decode path for every request).
        After `PROBE_AFTER` steps in a row without drafts or probes, one step asks the
        drafter for a draft per request anyway (a probe): what drafts are expected to
        yield is learnt only from drafts verified, and a pessimistic prior would otherwise
        never be tested. A probe the drafter has nothing for waits `PROBE_AFTER` steps
        like one that drafted: proposing is work, which a gate that declines drafts
        should not repeat every step."""

        costs = self.costs.scaled(self.scales)
        chosen, probed = [0], [False]
        lengths = [self._length(r) for r in batch]
        proposed = [lengths]  # the sizes the drafter last asked the cap for: what it could propose

        def cap(sizes: list[int]) -> int:
            proposed[0] = sizes
            expected = [self.lengths[r.rid].expected for r in batch]
            chosen[0] = draft_cap(costs, sizes, expected, model_steps=self.drafter.runner is not None)
            if not chosen[0] and self.undrafted >= PROBE_AFTER and max(sizes, default=0) > 0:
                chosen[0], probed[0] = 1, True
            return chosen[0]

        drafts = self.drafter.draft(sched.kv, batch, lengths, cap)
        self.undrafted = 0 if any(drafts) or probed[0] else self.undrafted + 1  # a probe that found nothing counts
        for r, n, size, d in zip(batch, lengths, proposed[0], drafts, strict=True):
            if n and not size:
                self.lengths[r.rid].empty()
            elif n and chosen[0] and not d:  # drafting was worth it, yet this one got none
                self.lengths[r.rid].missed()
        return drafts

    def _length(self, req: Req) -> int:
        """How many drafts `req` may verify now, as long as its adaptive length allows:
        none for a constrained request or one with several tokens pending."""
        if req.grammar is not None or req.seq_len - req.kv_len != 1:
            return 0
        room = req.params.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(self.lengths[req.rid].next(), room))

    def _accept(self, sched: Scheduler, req: Req, draft: list[int], accepted: int, drawn: Drawn, base: int) -> None:
        """Emit the target's tokens for `req` (rows from `base`) up to and including the
        first that differs from its draft, the `accepted` drafts before it kept (stopping
        early if one finishes it); free the rejected slots."""
        for j in range(accepted + 1):
            req.kv_len = req.seq_len  # the pending token and the drafts kept so far
            sched.emit(req, drawn, base + j)
            if req.finished:
                break
        req.spec_verify_ct += 1
        self.stats.request_steps += 1
        self.stats.emitted += j + 1
        if draft:
            self.stats.drafted += len(draft)
            self.stats.accepted += min(accepted, j + 1)
            self.lengths[req.rid].update(len(draft), accepted)
            self.prior.update(len(draft), accepted)
        if not req.finished:
            sched.kv.shrink(req)
