"""The scheduler: continuous batching over the model runner with radix prefix reuse.

One `step()`: admit and prefill (extend) waiting requests, or decode one token for every
running request; sample; retire finished requests into the radix cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sprig.radix import ReqToTokenPool, SlotAllocator, make_prefix_cache
from sprig.runtime.constrained import CompilerConfig
from sprig.runtime.detokenizer import DecodeDelta, DetokenizeConfig, RequestDetokenizer
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.sampling import SamplingBatch, sample
from sprig.runtime.sampling.logprobs import token_logprobs
from sprig.runtime.scheduler.admission import Admission, Extend
from sprig.runtime.scheduler.config import SchedulerConfig
from sprig.runtime.scheduler.grammar import GrammarError, Grammars
from sprig.runtime.scheduler.kv import RequestKV
from sprig.runtime.scheduler.output import collect_output
from sprig.runtime.scheduler.request import FinishReason, Req
from sprig.runtime.speculative import SpeculativeDecoder
from sprig.runtime.step_input import StepInput
from sprig.runtime.wire import TokenOutput

log = logging.getLogger("sprig.scheduler")
JUMP_CONTEXT_TOKENS = 4  # output tokens re-tokenized with a forced continuation


class RequestRejected(ValueError):
    """A request that can never be served as given (too long, bad ids, duplicate rid)."""


class QueueFull(RuntimeError):
    """More requests are queued than `max_queued_requests` allows."""


def _text_stop(delta: DecodeDelta) -> FinishReason | None:
    """How a stop string or `stop_regex` ends the request, if this step's text does."""
    if delta.stop_error is not None:
        return FinishReason("abort", message=delta.stop_error, status_code=400)
    return None if delta.stop_matched is None else FinishReason("stop", matched=delta.stop_matched)


@dataclass(frozen=True)
class Drawn:
    """One sampling call's tokens, their raw logprobs and top logprobs, per row."""

    ids: list[int]
    logprobs: list[float]
    top: tuple[list[list[float]], list[list[int]]] | None
    top_n: list[int]


@dataclass
class SchedulerStats:
    """Counters since start (tokens), for logs, metrics and benchmarks."""

    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens reused from the radix cache
    decode_tokens: int = 0  # tokens generated
    retractions: int = 0
    jump_forward_tokens: int = 0  # tokens appended without a decode step of their own
    steps: int = 0  # calls of `step`, idle ones included
    extend_steps: int = 0  # forward passes over new prompt tokens (chunks included)
    decode_steps: int = 0  # forward passes of one new token per running request


class Scheduler:
    """Holds requests and integer indices; the model runner owns every device tensor."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunner, tokenizer=None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        mc = runner.model_config
        self.context_len = mc.context_len
        self.vocab_size = mc.vocab_size
        self.eos_ids = tuple(mc.eos_token_ids)
        allocator = SlotAllocator(runner.num_slots, runner.config.page_size, check=config.check_integrity)
        cache = make_prefix_cache(
            allocator, enabled=not config.disable_radix_cache, policy=config.eviction_policy
        )
        table = ReqToTokenPool(config.max_running_requests, mc.context_len)
        self.kv = RequestKV(allocator, cache, table)
        self.admission = Admission(config, self.kv)
        self.grammars = Grammars(
            tokenizer, mc.vocab_size, CompilerConfig(timeout_s=config.grammar_compile_timeout_s),
            config.grammar_backend,
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.ratio = config.new_token_ratio
        self.stats = SchedulerStats()
        self.speculative = (
            None if config.speculative_algorithm is None
            else SpeculativeDecoder(config.speculative_algorithm, config.speculative_num_draft_tokens, self.kv.cache)
        )
        self._reqs: dict[str, Req] = {}
        self._sent: dict[str, tuple[int, bool]] = {}
        self._stop_checkers: dict[str, RequestDetokenizer] = {}
        self._aborted: list[Req] = []
        self._last_was_prefill = False

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Req) -> None:
        """Queue `req`; raises `RequestRejected` if it can never run, `QueueFull` if the
        queue is at its bound."""
        p = req.params
        if req.rid in self._reqs:
            raise RequestRejected(f"request id {req.rid!r} is already in use")
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        if bad := [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]:
            raise RequestRejected(f"input_ids contain token ids outside [0, {self.vocab_size}): {bad[:5]}")
        total = len(req.prompt_ids) + p.max_new_tokens
        if total > self.context_len:
            raise RequestRejected(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.context_len}"
            )
        if self.kv.pages(total) > self.kv.allocator.size:
            raise RequestRejected(
                f"prompt + max_new_tokens = {total} tokens exceeds the KV pool ({self.kv.allocator.size} tokens)"
            )
        try:
            p.validate_for_model(self.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        if req.top_logprobs_num < 0:
            raise RequestRejected(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}")
        if len(self.waiting) >= self.config.max_queued_requests:
            raise QueueFull(f"{len(self.waiting)} requests are queued (max_queued_requests); retry later")
        if p.stop or p.stop_regex:
            if self.tokenizer is None:
                raise RequestRejected("stop strings and stop_regex need the scheduler to have a tokenizer")
            config = DetokenizeConfig(
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop=p.stop,
                no_stop_trim=p.no_stop_trim,
                stop_regex=p.stop_regex,
            )
            self._stop_checkers[req.rid] = RequestDetokenizer(self.tokenizer, req.prompt_ids, config)
        try:
            self.grammars.submit(req)
        except GrammarError as e:
            raise RequestRejected(str(e)) from None
        req.stop_ids = p.stop_token_set(self.eos_ids)
        self._reqs[req.rid] = req
        self._sent[req.rid] = (0, False)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Stop `rid` wherever it is; its KV not kept in the tree is freed. False if unknown."""
        req = self._reqs.get(rid)
        if req is None or req.finished:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        self.kv.release(req)
        self.grammars.forget(rid)
        req.finish = FinishReason("abort", message="aborted")
        self._aborted.append(req)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._aborted)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are in flight."""
        if self.waiting or self.running or self.chunked:
            return False
        self.kv.cache.reset()
        return True

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def close(self) -> None:
        """Stop the grammar compile workers, if any were started."""
        self.grammars.close()

    # ------------------------------------------------------------------ the loop
    def step(self, *, partial: bool = True) -> list[TokenOutput]:
        """One scheduling step; returns what is new for each request it touched, or with
        `partial=False` only for those that finished (each then reports everything)."""
        touched: list[Req] = self._aborted
        self._aborted = []
        extends: list[Extend] = []
        if not (self._last_was_prefill and self.running):
            ready = self._admissible(touched)
            extends = self.admission.build(ready, self.running, self.chunked, self.ratio)
            for ext in extends:
                if ext.req in self.waiting:
                    self.waiting.remove(ext.req)
        if extends:
            touched += self._run_extend(extends)
            self._last_was_prefill = True
            self.stats.extend_steps += 1
        elif self.running:
            touched += self._run_decode()
            self._last_was_prefill = False
            self.stats.decode_steps += 1
        elif self.waiting and not self.chunked and not touched:
            if not self.grammars.has_pending:
                raise RuntimeError("no request can be admitted although nothing is running (KV pool too small?)")
            self.grammars.wait_any(timeout=0.05)
        self.stats.steps += 1
        if self.config.check_integrity:
            self.kv.check_integrity()
        return [self._collect(r) for r in touched if partial or r.finished]

    def _admissible(self, failed: list[Req]) -> list[Req]:
        """Waiting requests that may be admitted now: their grammar, if any, is compiled.
        Requests whose grammar failed to compile finish (400) and join `failed`."""
        ready = []
        for req in list(self.waiting):
            try:
                if self.grammars.ready(req, req.stop_ids):
                    ready.append(req)
            except GrammarError as e:
                self.waiting.remove(req)
                req.finish = FinishReason("abort", message=str(e), status_code=400)
                failed.append(req)
        return ready

    def _run_extend(self, extends: list[Extend]) -> list[Req]:
        firsts = [self._logits_from(e) for e in extends]
        ends = [e.req.kv_len + e.length for e in extends]
        step = StepInput(
            mode=ForwardMode.EXTEND,
            input_ids=[t for e in extends for t in e.req.fill_ids[e.req.kv_len : e.req.kv_len + e.length]],
            q_lens=[e.length for e in extends],
            kv_lens=ends,
            kv_indices=self.kv.contexts([e.req for e in extends], ends),
            logits_from=firsts,
        )
        logits = self.runner.forward(step)
        to_sample: list[Req] = []
        last_rows: list[torch.Tensor] = []
        offset = 0
        self.chunked = None
        for ext, first in zip(extends, firsts, strict=True):
            req, rows = ext.req, logits[offset : offset + ext.length - first]
            offset += ext.length - first
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, rows, req.kv_len + first)
            self.stats.prefill_tokens += ext.length
            self.stats.cached_tokens += ext.cached
            completes = ext.completes
            req.kv_len += ext.length
            self.kv.cache_prefix(req)
            if not completes:
                self.chunked = req
                continue
            req.input_logprobs_done = True
            if req.params.max_new_tokens == 0:
                self._finish(req, FinishReason("length", length=0))
                continue
            to_sample.append(req)
            last_rows.append(rows[-1])
            self.running.append(req)
        if to_sample:
            self._sample(to_sample, torch.stack(last_rows))
        return [e.req for e in extends]

    def _run_decode(self) -> list[Req]:
        """One token for every running request, or more where speculative drafts are
        accepted (`speculative.decode`)."""
        self._make_room_for_decode()
        batch = self._decode_plain() if self.speculative is None else self.speculative.decode(self)
        self.ratio = max(self.config.min_new_token_ratio, self.ratio - self.config.new_token_ratio_decay)
        return batch

    def _decode_plain(self) -> list[Req]:
        """A request with jump-forward tokens pending feeds them all in the same step (the
        step then runs in extend mode)."""
        batch = list(self.running)
        pending = [r.seq_len - r.kv_len for r in batch]
        mode = ForwardMode.DECODE if max(pending) == 1 else ForwardMode.EXTEND
        ends = [r.kv_len + n for r, n in zip(batch, pending, strict=True)]
        step = StepInput(
            mode=mode,
            input_ids=[t for r in batch for t in r.pending_ids()],
            q_lens=pending,
            kv_lens=ends,
            kv_indices=self.kv.contexts(batch, ends),
            logits_from=[n - 1 for n in pending],
        )
        logits = self.runner.forward(step)
        for r, n in zip(batch, pending, strict=True):
            r.kv_len += n
        self._sample(batch, logits)
        return batch

    def _make_room_for_decode(self) -> None:
        """Reserve slots for every running request's pending tokens; retract requests when
        the pool, after evicting cold cache, cannot supply them: a running request (one
        stays) or the request part-way through a chunked prefill, whichever frees the most
        slots per token of work it may redo. One request always fits (`add_request`)."""
        while not self.kv.reserve_all(self.running):
            candidates = self.running[:] if len(self.running) > 1 else []
            if self.chunked is not None:
                candidates.append(self.chunked)
            if not candidates:
                raise RuntimeError("no KV slots for the running requests even after retraction")
            self._retract(max(candidates, key=self._retract_priority))

    @staticmethod
    def _retract_priority(req: Req) -> float:
        """Slots a retraction frees per token of work it may have to redo."""
        return req.own_slots / (len(req.output_ids) + 1)

    def _retract(self, req: Req) -> None:
        """Requeue `req`, its KV released to the tree; its output so far is kept. Input
        logprobs of a prompt not yet fully prefilled are recorded again by the next
        prefill."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        if not req.input_logprobs_done:
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()
        self.kv.release(req)
        req.retractions += 1
        self.waiting.append(req)
        self.stats.retractions += 1
        self.ratio = self.config.new_token_ratio
        log.info("retracted request %s (%d tokens generated) to free KV slots", req.rid, len(req.output_ids))

    # ------------------------------------------------------------------ sampling and stopping
    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> None:
        drawn = self.draw(reqs, logits, [r.output_ids for r in reqs])
        for b, req in enumerate(reqs):
            self.emit(req, drawn, b)

    def draw(self, reqs: list[Req], logits: torch.Tensor, outputs: list[list[int]]) -> Drawn:
        """Sample row b of `logits` for `reqs[b]` as if it had generated `outputs[b]` so far
        (a request may fill several rows: speculative verification)."""
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            output_ids=outputs,
            prompt_ids=[r.prompt_ids for r in reqs] if any(r.params.repetition_penalty != 1.0 for r in reqs) else None,
            eos_ids=self.eos_ids,
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
        top_n = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        logits = self.grammars.mask(reqs, logits)
        wanted = any(r.return_logprob for r in reqs)
        out = sample(logits, batch, top_logprobs_num=top_n, logprobs=wanted, generator=self.runner.generator)
        logprobs = out.logprobs.tolist() if out.logprobs is not None else []
        top = (out.top_logprobs.values.tolist(), out.top_logprobs.ids.tolist()) if out.top_logprobs else None
        return Drawn(out.next_ids.tolist(), logprobs, top, top_n)

    def emit(self, req: Req, drawn: Drawn, b: int) -> None:
        """Append row b's token to `req` (with its logprobs) and check whether it stops."""
        token = drawn.ids[b]
        req.output_ids.append(token)
        self.stats.decode_tokens += 1
        if req.return_logprob:
            req.output_logprobs.append((drawn.logprobs[b], token))
            top, n = drawn.top, drawn.top_n[b]
            if top is not None and n:
                req.output_top_logprobs.append(list(zip(top[0][b][:n], top[1][b][:n], strict=True)))
        self._check_stop(req, token)

    def _check_stop(self, req: Req, token: int) -> None:
        p, n_out = req.params, len(req.output_ids)
        reason = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            reason = FinishReason("abort", message=f"the grammar refused sampled token {token}")
        elif token in req.stop_ids and n_out >= p.min_new_tokens:
            reason = FinishReason("stop", matched=token)
        elif req.grammar is not None and req.grammar.is_finished():
            reason = FinishReason("stop", matched=None)
        elif (checker := self._stop_checkers.get(req.rid)) is not None:
            reason = _text_stop(checker.step([token]))
        if reason is None and n_out >= p.max_new_tokens:
            reason = FinishReason("length", length=n_out)
        if reason is None and len(req.prompt_ids) + n_out >= self.context_len:
            reason = FinishReason("length", length=n_out)
        if reason is not None:
            self._finish(req, reason)
        elif req.grammar is not None and self.config.enable_jump_forward and not req.return_logprob:
            self._jump_forward(req)

    def _jump_forward(self, req: Req) -> None:
        """Append the text the grammar forces next (e.g. `{"name":"`) without sampling it.

        The forced text is tokenized in context (after the last few output tokens); the
        jump happens only where that tokenization keeps the existing tokens, so no
        emitted token is ever taken back. The tokens are fed in the next step at once.
        """
        forced = req.grammar.forced_continuation()
        room = min(req.params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len - 1)
        if not forced or room <= 0 or self.tokenizer is None:
            return
        tail = req.output_ids[-JUMP_CONTEXT_TOKENS:]
        context = self.tokenizer.decode(tail)
        if "\ufffd" in context:
            return
        ids = self.tokenizer.encode(context + forced, add_special_tokens=False)
        if ids[: len(tail)] != tail:
            return
        new = ids[len(tail) : len(tail) + room]
        if not new or not req.grammar.accept_tokens(new):
            return
        req.output_ids.extend(new)
        req.jump_forward_tokens += len(new)
        self.stats.jump_forward_tokens += len(new)
        checker = self._stop_checkers.get(req.rid)
        reason = _text_stop(checker.step(new)) if checker is not None else None
        if reason is not None:
            self._finish(req, reason)
        elif req.grammar.is_finished() or len(req.output_ids) >= req.params.max_new_tokens:
            self._finish(req, FinishReason("stop" if req.grammar.is_finished() else "length",
                                           matched=None, length=len(req.output_ids)))

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish = reason
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)

    # ------------------------------------------------------------------ logprobs and outputs
    def _logits_from(self, ext: Extend) -> int:
        """First new-token row whose logits this step needs (the last one at least)."""
        req = ext.req
        if not req.wants_input_logprobs:
            return ext.length - 1
        first_needed = max(req.logprob_start_len, 1) - 1
        return min(max(0, first_needed - req.kv_len), ext.length - 1)

    def _record_input_logprobs(self, req: Req, rows: torch.Tensor, first_pos: int) -> None:
        """`rows[i]` holds the model's prediction after position `first_pos + i`; record the
        logprob of each prompt token at or after `logprob_start_len` it predicts."""
        prompt, start = req.prompt_ids, req.logprob_start_len
        if start == 0 and not req.input_logprobs:
            req.input_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
        positions = [first_pos + i for i in range(rows.shape[0])]
        keep = [i for i, pos in enumerate(positions) if max(start, 1) <= pos + 1 < len(prompt)]
        if not keep:
            return
        targets = torch.tensor([prompt[positions[i] + 1] for i in keep], device=rows.device)
        chosen, top = token_logprobs(rows[keep], targets, top_k=req.top_logprobs_num)
        top_vals = (top.values.tolist(), top.ids.tolist()) if top is not None else None
        for j, (lp, tok) in enumerate(zip(chosen.tolist(), targets.tolist(), strict=True)):
            req.input_logprobs.append((lp, tok))
            req.input_top_logprobs.append(
                list(zip(top_vals[0][j], top_vals[1][j], strict=True)) if top_vals else None
            )

    def _collect(self, req: Req) -> TokenOutput:
        sent_ids, sent_input = self._sent.get(req.rid, (0, False))
        out = collect_output(req, sent_ids, sent_input)
        if req.finished:
            self._reqs.pop(req.rid, None)
            self._sent.pop(req.rid, None)
            self._stop_checkers.pop(req.rid, None)
        else:
            self._sent[req.rid] = (len(req.output_ids), sent_input or out.input_logprobs is not None)
        return out
