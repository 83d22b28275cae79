"""The speculative decode step: draft, verify every request's drafts (and the alternative
paths of a token tree, `tree`) in one forward pass of the target, keep what the
acceptance rule accepts.

Invariants:
- Each request's tokens are exactly what the plain decode step would emit one step at a
  time: target row j of a path is sampled as if the request's output already held the
  path's first j tokens (same penalties, min-new-tokens ban and seeded noise), and
  `tree_walk` keeps drafts only while they equal those tokens.
- KV: drafts and alternative paths get slots only from the free list (they never evict
  cache or retract); a rejected draft's slots, and those of every path not followed,
  are freed in the same step; `kv_len` covers only accepted
  tokens, so what a request releases to the radix tree is verified. A drafter that keeps
  KV of its own at the target's slots (the draft model) sees every extend the scheduler
  runs and every decode step in which nothing was drafted (`mirror`) and, before any
  verified token is emitted, which tokens each verification pass keeps (`verified`).
- A constrained request's draft, and each of its alternative paths, is cut to what its
  grammar takes (`grammar_drafts`), and each of their rows is masked by the grammar as it
  would be after the path's tokens before it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from sprig.runtime.constrained import bitmask_width
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.speculative.accept import tree_walk
from sprig.runtime.speculative.calibrate import calibrate
from sprig.runtime.speculative.cost import PassCosts, Scales, branch_gain, draft_cap, widen
from sprig.runtime.speculative.draft_length import START_RATE, AcceptanceRate, DraftLength
from sprig.runtime.speculative.draft_model import DraftModel
from sprig.runtime.speculative.drafter import DRAFTERS
from sprig.runtime.speculative.grammar_drafts import grammar_rows
from sprig.runtime.speculative.tree import Branch, shared_prefix

log = logging.getLogger("sprig.scheduler")
PRIOR_DECAY = 0.9  # per verification, the weight of the past in the acceptance a new request is assumed to have
PROBE_AFTER = 64  # steps in a row without drafts or probes, after which one step asks for a draft per request
MAX_QUIET = 16  # steps, at most, the drafter is left unasked after the gate declined its proposals

if TYPE_CHECKING:
    from sprig.radix import PrefixCache
    from sprig.runtime.model_runner import ModelRunner
    from sprig.runtime.scheduler.config import SchedulerConfig
    from sprig.runtime.scheduler.request import Req
    from sprig.runtime.scheduler.scheduler import Drawn, Scheduler


@dataclass
class SpeculativeStats:
    """Counters since start: verification passes, drafts verified (a token tree's tokens
    each once), drafts accepted and tokens emitted by the passes (accepted drafts plus
    one target token per request)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    request_steps: int = 0  # (request, verification pass) pairs
    alternatives: int = 0  # alternative paths verified beside drafts (token trees)
    alternatives_kept: int = 0  # of them, those the kept tokens lay on (one drafted token at least)

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
        self.width = config.speculative_alternatives
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
        self.backoff = 0  # the quiet steps the gate's next decline in a row sets: 0, 1, 3, 7, ... `MAX_QUIET`
        self.quiet = 0  # steps left in which the drafter is not asked (after declines, while no request joins `quiet_batch`)
        self.quiet_batch: frozenset[str] = frozenset()
        self.probed = False  # the last drafts were a probe's
        self.refused: set[str] = set()  # requests whose grammar refused a token of this step's drafts
        self.stats = SpeculativeStats()

    def decode(self, sched: Scheduler) -> list[Req]:
        """One verification pass over every running request (room for their pending tokens
        already reserved); returns the requests it touched."""
        batch = list(sched.running)
        self.lengths = {r.rid: self.lengths.get(r.rid) or DraftLength(self.max_len, rate=self.prior.rate) for r in batch}
        start = time.perf_counter()
        drafts, limits = self._drafts(sched, batch)
        if not any(drafts):
            return self._plain(sched, batch)
        self.refused = set()
        bitmasks = self._fit(sched, batch, drafts)
        branches = self._branches(sched, batch, drafts, limits)
        drafted = time.perf_counter()
        step = self._step(sched, batch, drafts, branches)
        logits = sched.runner.forward(step)  # [sum(len(d) + 1) + the branches' rows, V]
        rows = [r for r, d in zip(batch, drafts, strict=True) for _ in range(len(d) + 1)]
        outputs = [r.output_ids + d[:j] for r, d in zip(batch, drafts, strict=True) for j in range(len(d) + 1)]
        for b in branches:
            req = batch[b.owner]
            rows += [req] * (len(b.tokens) - b.depth)
            outputs += [req.output_ids + b.tokens[:j] for j in range(b.depth + 1, len(b.tokens) + 1)]
        if bitmasks is not None:
            for b in branches:
                bitmasks += b.masks or [None] * (len(b.tokens) - b.depth)
        drawn = sched.draw(rows, logits, outputs, bitmasks)
        if self.measured:
            self._time(step, drafts, drafted - start, time.perf_counter() - drafted)
        paths: list[list[list[int]]] = [[d] for d in drafts]
        ends = list(accumulate(len(d) + 1 for d in drafts))  # past each request's rows
        row0 = [[end - len(d) - 1] for end, d in zip(ends, drafts, strict=True)]  # per request and path: its depth 0's row
        trees = [len(d) for d in drafts]  # drafted tokens verified per request, each once
        first = ends[-1]
        for b in branches:
            paths[b.owner].append(b.tokens)
            row0[b.owner].append(first - b.depth - 1)  # its rows start at depth + 1
            first += len(b.tokens) - b.depth
            trees[b.owner] += len(b.tokens) - b.depth
        walks = [tree_walk(p, lambda k, j, r=r: drawn.ids[r[k] + j]) for p, r in zip(paths, row0, strict=True)]
        self._keep_slots(sched, batch, branches, walks)
        followed = [p[w[-1][0]] for p, w in zip(paths, walks, strict=True)]
        pending = [r.seq_len - r.kv_len for r in batch]
        self.drafter.verified(sched.kv, batch, followed, [n + len(w) - 1 for n, w in zip(pending, walks, strict=True)])
        for req, path, walk, rows0, tree in zip(batch, followed, walks, row0, trees, strict=True):
            self._accept(sched, req, path, [rows0[k] + j for k, j in walk], drawn, tree)
        self.stats.verify_steps += 1
        return batch

    def _fit(self, sched: Scheduler, batch: list[Req], drafts: list[list[int]]) -> list[torch.Tensor | None] | None:
        """Cut each constrained request's draft (in place) to what its grammar takes
        (`grammar_rows`; jump-forward runs for it as `Scheduler._check_stop` runs it), and
        return the grammar bitmask of each row of the requests' drafts (None for an
        unconstrained request's rows), or None when no request is constrained. A draft
        token the grammar refuses counts as rejected for the request's draft length
        (`refused`: it adapts as if the target had refused it). The cap
        was chosen for the drafts before the cut: where one was cut, `draft_cap` chooses
        again for what is left (the drafting is done, so its cost is not counted; a
        probe's drafts are kept), and may cap every draft lower, or drop them all. The
        slots of the tokens cut are freed with the rejected ones (`RequestKV.shrink`)."""
        if all(r.grammar is None for r in batch):
            return None
        width = bitmask_width(sched.grammars.logits_width)
        jumps = sched.config.enable_jump_forward
        masks: list[list[torch.Tensor] | None] = []
        cut = False
        for i, req in enumerate(batch):
            if req.grammar is None:
                masks.append(None)
                continue
            kept, rows, refused = grammar_rows(req.grammar, drafts[i], width, jumps and not req.return_logprob)
            if refused:
                self.refused.add(req.rid)
            cut |= len(kept) < len(drafts[i])
            drafts[i] = kept
            masks.append(rows)
        if cut and not self.probed:
            cap = draft_cap(self.costs.scaled(self.scales), [len(d) for d in drafts],
                            [self.lengths[r.rid].expected for r in batch], model_steps=False)
            drafts[:] = [d[:cap] for d in drafts]
        bitmasks: list[torch.Tensor | None] = []
        for d, rows in zip(drafts, masks, strict=True):
            bitmasks += [None] * (len(d) + 1) if rows is None else rows[: len(d) + 1]
        return bitmasks

    def _plain(self, sched: Scheduler, batch: list[Req]) -> list[Req]:
        """A step in which no request drafts: the scheduler's plain decode step (the same
        pass and tokens as a verification of no drafts, without its per-request walk),
        counted and timed as a verification pass that verified none."""
        sched.decode_plain((lambda s: self.scales.observe("decode", self.costs.decode.at(len(batch)), s * 1e3))
                           if self.measured else None)
        for req in batch:
            req.count_verification(0, 0)
        self.stats.verify_steps += 1
        self.stats.request_steps += len(batch)
        self.stats.emitted += len(batch)
        return batch

    @staticmethod
    def _step(sched: Scheduler, batch: list[Req], drafts: list[list[int]], branches: list[Branch]) -> ForwardStep:
        """The verification pass: each request's pending tokens and draft (logits from its
        last pending token on), then each alternative path after its owner's pending token
        (logits from the token after the prefix it shares with the draft on)."""
        pending = [r.seq_len - r.kv_len for r in batch]
        q_lens = [n + len(d) for n, d in zip(pending, drafts, strict=True)]
        ends = [r.kv_len + q for r, q in zip(batch, q_lens, strict=True)]
        contexts = [sched.kv.contexts(batch, ends)]
        for b in branches:
            req = batch[b.owner]
            contexts += [sched.kv.contexts([req], [req.kv_len]), b.slots.to(contexts[0].dtype)]
        return ForwardStep(
            mode=ForwardMode.DECODE if max(q_lens) == 1 and not branches else ForwardMode.EXTEND,
            input_ids=[t for r, d in zip(batch, drafts, strict=True) for t in r.pending_ids() + d]
            + [t for b in branches for t in batch[b.owner].pending_ids() + b.tokens],
            q_lens=q_lens + [1 + len(b.tokens) for b in branches],
            kv_lens=ends + [batch[b.owner].kv_len + 1 + len(b.tokens) for b in branches],
            kv_indices=torch.cat(contexts) if branches else contexts[0],
            logits_from=[n - 1 for n in pending] + [b.depth + 1 for b in branches],
            lora_slots=sched.lora_slots(batch + [batch[b.owner] for b in branches]),
        )

    def _keep_slots(self, sched: Scheduler, batch: list[Req], branches: list[Branch],
                    walks: list[list[tuple[int, int]]]) -> None:
        """A request whose kept tokens lie on an alternative path takes that path's slots
        for its pending token and those tokens; every other slot of the branches is freed."""
        seen = [0] * len(batch)
        for b in branches:
            seen[b.owner] += 1  # this branch is path `seen[b.owner]` of its owner
            walk = walks[b.owner]
            if walk[-1][0] == seen[b.owner]:
                self.stats.alternatives_kept += 1
                kept = len(walk)  # the pending token and the drafts kept
                sched.kv.adopt(batch[b.owner], batch[b.owner].kv_len, b.slots[:kept])
                sched.kv.free(b.slots[kept:])
            else:
                sched.kv.free(b.slots)

    def _time(self, step: ForwardStep, drafts: list[list[int]], drafting_s: float, pass_s: float) -> None:
        """Correct the cost lines by what this pass took (the target's forward and the
        draw, and the draft model's steps)."""
        sequences, tokens = len(step.q_lens), sum(step.q_lens)
        if tokens > sequences:
            self.scales.observe("verify", self.costs.verify.at(sequences, tokens), pass_s * 1e3)
        else:
            self.scales.observe("decode", self.costs.decode.at(sequences), pass_s * 1e3)
        if isinstance(self.drafter, DraftModel) and tokens > sequences:  # its catching up on prompts is not a step
            steps = max(len(d) for d in drafts)
            live = [sum(1 for d in drafts if len(d) > j) for j in range(steps)]
            self.scales.observe("draft", sum(self.costs.draft.at(n) for n in live),
                                (drafting_s - self.drafter.extend_s) * 1e3)

    def mirror(self, step: ForwardStep) -> None:
        """The scheduler ran `step` on the target: an extend, or a plain decode step."""
        self.drafter.mirror(step)

    def _drafts(self, sched: Scheduler, batch: list[Req]) -> tuple[list[list[int]], list[int]]:
        """The drafts each request verifies this step, their slots reserved, and how many
        each could have had (its limit, under the cap): as many as
        `draft_cap` finds worth their cost (none at all when the plain pass is expected
        to be as fast: a pass with drafts leaves the decode path for every request).
        After `PROBE_AFTER` steps in a row without drafts or probes, one step asks the
        drafter for a draft per request anyway (a probe): what drafts are expected to
        yield is learnt only from drafts verified, and a pessimistic prior would otherwise
        never be tested. A probe the drafter has nothing for waits `PROBE_AFTER` steps
        like one that drafted: proposing is work, which a gate that declines drafts
        should not repeat every step. Likewise a gate that declines what the drafter
        proposes leaves it unasked for 0, 1, 3, 7, ... (at most `MAX_QUIET`) steps after
        each decline in a row, unless a request joins the batch or a probe is due: the same
        requests would be declined again, and asking costs the host every step. A request
        leaving does not end the quiet (in a batch of many, one finishes almost every step)."""
        if self.quiet and self.undrafted < PROBE_AFTER and self.quiet_batch.issuperset(r.rid for r in batch):
            self.quiet -= 1
            self.undrafted += 1
            return [[] for _ in batch], [0] * len(batch)
        costs = self.costs.scaled(self.scales)
        chosen, probed = [0], [False]
        lengths = [self._length(r) for r in batch]
        if not any(lengths):  # every request paused, constrained or at its end: nothing to ask for
            self.undrafted += 1
            return [[] for _ in batch], lengths
        proposed = [lengths]  # the sizes the drafter last asked the cap for: what it could propose

        def cap(sizes: list[int]) -> int:
            proposed[0] = sizes
            expected = [self.lengths[r.rid].expected for r in batch]
            chosen[0] = draft_cap(costs, sizes, expected, model_steps=self.drafter.runner is not None)
            if not chosen[0] and self.undrafted >= PROBE_AFTER and max(sizes, default=0) > 0:
                chosen[0], probed[0] = 1, True
            return chosen[0]

        drafts = self.drafter.draft(sched.kv, batch, lengths, cap)
        self.probed = probed[0]
        self.undrafted = 0 if any(drafts) or probed[0] else self.undrafted + 1  # a probe that found nothing counts
        if chosen[0] and not probed[0]:
            self.backoff = self.quiet = 0
        elif not chosen[0] and max(proposed[0], default=0) > 0:
            self.quiet, self.quiet_batch = self.backoff, frozenset(r.rid for r in batch)
            self.backoff = min(2 * self.backoff + 1, MAX_QUIET)
        for r, n, size, d in zip(batch, lengths, proposed[0], drafts, strict=True):
            if n and not size:
                self.lengths[r.rid].empty()
            elif n and chosen[0] and not d:  # drafting was worth it, yet this one got none
                self.lengths[r.rid].missed()
        return drafts, [min(n, chosen[0]) for n in lengths]

    def _branches(self, sched: Scheduler, batch: list[Req], drafts: list[list[int]],
                  limits: list[int]) -> list[Branch]:
        """The alternative paths verified beside the drafts (a token tree, `tree`): those
        the drafter proposes that raise the pass's expected tokens per millisecond
        (`cost.widen`), their slots taken from the free list; none where pages hold more
        than one slot. A constrained request's chosen path is then cut to what its grammar
        takes and carries the bitmask of each of its rows (`grammar_rows`, as `_fit` does
        for drafts): only chosen paths walk the grammar, each step's host work."""
        if sched.kv.page_size != 1 or not self.width or not any(drafts):
            return []
        proposed = self.drafter.alternatives(batch, drafts, limits, self.width)
        candidates = []
        for i, (r, d, paths) in enumerate(zip(batch, drafts, proposed, strict=True)):
            rate = self.lengths[r.rid].acceptance.rate
            for path in paths:
                depth = shared_prefix(path, d)
                if depth < len(path):
                    candidates.append((i, path, depth, branch_gain(rate, depth, len(path), len(d))))
        if not candidates:
            return []
        tokens = sum(r.seq_len - r.kv_len + len(d) for r, d in zip(batch, drafts, strict=True))
        expected = len(batch) + sum(self.lengths[r.rid].expected(len(d)) for r, d in zip(batch, drafts, strict=True))
        chosen = widen(self.costs.scaled(self.scales), len(batch), tokens, expected,
                       [(gain, 1 + len(path)) for _, path, _, gain in candidates])
        width = bitmask_width(sched.grammars.logits_width)
        branches: list[Branch] = []
        for k in chosen:
            i, path, depth, _ = candidates[k]
            req, masks = batch[i], None
            if req.grammar is not None:
                jumps = sched.config.enable_jump_forward and not req.return_logprob
                path, rows, _ = grammar_rows(req.grammar, path, width, jumps)
                if len(path) <= depth or any(b.owner == i and b.tokens == path for b in branches):
                    continue  # cut to the draft's tokens, or to another chosen path
                masks = rows[depth + 1 : len(path) + 1]
            slots = sched.kv.take_free(1 + len(path))
            if slots is None:
                break
            branches.append(Branch(i, path, depth, slots, masks))
        self.stats.alternatives += len(branches)
        return branches

    def _length(self, req: Req) -> int:
        """How many drafts `req` may verify now, as long as its adaptive length allows:
        none for a request with several tokens pending."""
        if req.seq_len - req.kv_len != 1:
            return 0
        room = req.params.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(self.lengths[req.rid].next(), room))

    def _accept(self, sched: Scheduler, req: Req, path: list[int], rows: list[int], drawn: Drawn, tree: int) -> None:
        """Emit the target's tokens for `req` from `rows` (the drafts of `path` kept, then
        the target's own token; stopping early if one finishes it), `tree` drafts having
        been verified for it; free the rejected slots."""
        accepted, emitted = len(rows) - 1, 0
        for row in rows:
            req.kv_len = req.seq_len  # the pending token and the drafts kept so far
            sched.emit(req, drawn, row)
            emitted += 1
            if req.finished:
                break
        kept = min(accepted, emitted)
        req.count_verification(tree, kept)
        self.stats.request_steps += 1
        self.stats.emitted += emitted
        self.stats.drafted += tree
        self.stats.accepted += kept
        drafted = len(path) + (req.rid in self.refused)  # a refused draft token was checked and rejected
        if drafted:
            self.lengths[req.rid].update(drafted, accepted)
            self.prior.update(drafted, accepted)
        if not req.finished:
            sched.kv.shrink(req)
