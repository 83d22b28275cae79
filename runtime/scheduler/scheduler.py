"""The scheduler: continuous batching over the model runner with radix prefix reuse.

One `step()`: admit and prefill (extend) waiting requests, or decode one token for every
running request; sample; retire finished requests into the radix cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from sprig.radix import ReqToTokenPool, SlotAllocator, make_prefix_cache
from sprig.runtime.constrained import CompilerConfig
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner, WeightUpdateError
from sprig.runtime.scheduler.admission import Admission, Extend
from sprig.runtime.scheduler.config import SchedulerConfig, priority_rank
from sprig.runtime.scheduler.draw import Drawn, draw_tokens
from sprig.runtime.scheduler.grammar import GrammarError, Grammars
from sprig.runtime.scheduler.intake import Limits, RequestRejected, check_request
from sprig.runtime.scheduler.kv import RequestKV
from sprig.runtime.scheduler.logprob_record import logits_from, record_input_logprobs
from sprig.runtime.scheduler.output import collect_output
from sprig.runtime.scheduler.request import FinishReason, Req
from sprig.runtime.scheduler.step_images import extend_images
from sprig.runtime.scheduler.stops import Stops
from sprig.runtime.speculative.decode import SpeculativeDecoder
from sprig.runtime.wire import TokenOutput

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's `/pause_generation` modes (`Scheduler.pause`)
LORA_OFF = "LoRA is not enabled (start with lora_paths, or enable_lora with lora_target_modules and max_lora_rank)"

log = logging.getLogger("sprig.scheduler")


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
    preemptions: int = 0  # running requests retracted for a waiting one of higher priority


class Scheduler:
    """Holds requests and integer indices; the model runner owns every device tensor."""

    def __init__(self, config: SchedulerConfig, runner: ModelRunner, tokenizer=None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        mc = runner.model_config
        self.context_len = mc.context_len
        self.vocab_size = mc.vocab_size
        self.bidirectional_images = mc.image is not None and mc.image.bidirectional
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
            else SpeculativeDecoder(config, self.kv.cache, runner)
        )
        self.limits = Limits(mc.context_len, allocator.size, allocator.page_size,
                             config.max_queued_requests)
        self.stops = Stops(tokenizer, mc.context_len)
        self._reqs: dict[str, Req] = {}
        self._sent: dict[str, tuple[int, bool]] = {}
        self._aborted: list[Req] = []
        self._last_was_prefill = False
        self.weight_version = config.weight_version
        self.paused: str | None = None  # the mode of the pause in effect (`pause`); None: generating

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Req) -> None:
        """Queue `req`; raises `RequestRejected` if it can never run, `QueueFull` if the
        queue is at its bound (`intake.check_request`)."""
        check_request(req, self.limits, known=req.rid in self._reqs, queued=len(self.waiting))
        if req.priority and not self.config.enable_priority_scheduling:
            raise RequestRejected("priority is only taken under priority scheduling (--enable-priority-scheduling)")
        if req.lora_name is not None:
            req.lora_slot = self.lora_slot(req.lora_name)
        try:
            self.stops.register(req)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        try:
            self.grammars.submit(req)
        except GrammarError as e:
            self.stops.forget(req.rid)
            raise RequestRejected(str(e)) from None
        req.stop_ids = req.params.stop_token_set(self.eos_ids)
        req.weight_version = self.weight_version
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
        """Whether `step` has anything to do: while paused, only aborted requests to retire."""
        if self.paused is not None:
            return bool(self._aborted)
        return bool(self.waiting or self.running or self.chunked or self._aborted)

    @property
    def holds_kv(self) -> bool:
        """Whether a request holds K/V: one running, or part-way through its prefill
        (a waiting request holds none: a retracted one released its own to the tree)."""
        return bool(self.running or self.chunked)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while a request holds K/V (`holds_kv`)."""
        if self.holds_kv:
            return False
        self.kv.cache.reset()
        return True

    # ------------------------------------------------------------------ pausing
    def pause(self, mode: str) -> int:
        """Stop generating until `resume` (SGLang's `/pause_generation`); returns how many
        requests `mode` acted on. "abort" aborts every request in flight; "retract"
        requeues every running request, and one part-way through its prefill, its K/V
        released to the tree and its output kept: it resumes as after any retraction,
        with the same tokens, and nothing holds K/V while paused (weights may change then);
        "in_place" leaves every request where it is, K/V included. While paused a step
        only retires aborted requests, and new requests wait in the queue. Pausing again
        applies the new mode to what is there. ValueError for another mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        held = self.running + ([self.chunked] if self.chunked is not None else [])
        if mode == "abort":
            held += self.waiting
            for req in held:
                self.abort(req.rid)
        elif mode == "retract":
            for req in held:
                self._retract(req, "to pause generation")
        self.paused = mode
        return len(held)

    def resume(self) -> None:
        """Generate again after `pause` (SGLang's `/continue_generation`); nothing if not paused."""
        self.paused = None

    # ------------------------------------------------------------------ LoRA adapters
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path (empty without LoRA)."""
        lora = self.runner.lora
        return {} if lora is None else {a.name: a.path for a in lora.loaded.values()}

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the adapter at `path` under `name` (`LoRAManager.load`); ValueError saying
        why not (nothing changes then). Requests may run meanwhile: none uses the new slot,
        whose cached prefixes were dropped when its last adapter was unloaded."""
        if self.runner.lora is None:
            raise ValueError(LORA_OFF)
        self.runner.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter `name` and drop the prefixes cached with it; ValueError if it is
        not loaded or a request in flight uses it."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError(LORA_OFF)
        slot = lora.get(name).slot
        if any(r.lora_slot == slot and not r.finished for r in self._reqs.values()):
            raise ValueError(f"LoRA adapter {name!r} is in use by requests in flight")
        lora.unload(name)
        self.kv.cache.drop_namespace(slot + 1)

    def lora_slots(self, reqs: list[Req]) -> list[int] | None:
        """Each request's adapter slot for a `ForwardStep` (None without LoRA)."""
        return None if self.runner.lora is None else [r.lora_slot for r in reqs]

    def lora_slot(self, name: str) -> int:
        """The slot of loaded adapter `name`; `RequestRejected` saying why not."""
        if self.runner.lora is None:
            raise RequestRejected(f"lora_path {name!r}: {LORA_OFF}")
        try:
            return self.runner.lora.get(name).slot
        except ValueError as e:
            raise RequestRejected(f"lora_path: {e}") from None

    def update_weights(self, model_path: str, weight_version: str | None = None) -> None:
        """Load the weights at `model_path` (`ModelRunner.update_weights`), then
        `weights_loaded`. Only between requests: RuntimeError while any is in flight, so no
        request runs on two sets of weights. A checkpoint that does not load raises
        `WeightUpdateError` (a ValueError) with the old weights in place."""
        self._check_idle()
        try:
            self.runner.update_weights(model_path)
        except WeightUpdateError:
            self.weights_loaded(None)
            raise
        self.weights_loaded(weight_version)

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]],
                                    weight_version: str | None = None) -> int:
        """`ModelRunner.update_weights_from_tensors` (how many tensors were copied), then
        `weights_loaded`; only between requests, as `update_weights`. A tensor that does
        not fit raises `WeightUpdateError` with nothing changed."""
        self._check_idle()
        copied = self.runner.update_weights_from_tensors(tensors)
        self.weights_loaded(weight_version)
        return copied

    def _check_idle(self) -> None:
        if self.waiting or self.running or self.chunked:
            raise RuntimeError("weights change only while no request is in flight")

    def weights_loaded(self, weight_version: str | None) -> None:
        """After the runner loaded weights, or tried to: drop every cached prefix (K/V the
        old weights computed); `weight_version`, if given, labels the requests taken from
        now on and those waiting (no request holds K/V now: those waiting run on the new
        weights, a request paused by retraction included, whose prompt and output so far
        are computed again)."""
        self.kv.cache.reset()
        if weight_version is not None:
            self.weight_version = weight_version
            for req in self.waiting:
                req.weight_version = weight_version

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.speculative is not None:
            self.speculative.drafter.check(self.kv)

    def close(self) -> None:
        """Stop the grammar compile workers, if any were started."""
        self.grammars.close()

    # ------------------------------------------------------------------ the loop
    def step(self, *, partial: bool = True) -> list[TokenOutput]:
        """One scheduling step; returns what is new for each request it touched, or with
        `partial=False` only for those that finished (each then reports everything)."""
        touched: list[Req] = self._aborted
        self._aborted = []
        if self.paused is not None:
            return [self._collect(r) for r in touched if partial or r.finished]
        extends: list[Extend] = []
        if not (self._last_was_prefill and self.running):
            ready = self._admissible(touched)
            if ready and self.config.enable_priority_scheduling and self.chunked is None:
                self._preempt_for(ready)
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
            self.check_integrity()
        return [self._collect(r) for r in touched if partial or r.finished]

    def _preempt_for(self, ready: list[Req]) -> None:
        """Retract running requests, lowest priority first (the latest to arrive among
        equals), while the first of the highest priority among `ready` has no room and
        outranks them by more than the preemption threshold. Their outputs are kept: they
        resume, as after any retraction, when their turn comes again."""
        config = self.config
        low_first = config.schedule_low_priority_values_first
        first = min(ready, key=lambda r: (priority_rank(r.priority, low_first), r.arrival))
        rank = priority_rank(first.priority, low_first)
        while self.running and self.admission.blocked(first, self.running, self.ratio):
            victim = max(self.running, key=lambda r: (priority_rank(r.priority, low_first), r.arrival))
            if priority_rank(victim.priority, low_first) - rank <= config.priority_scheduling_preemption_threshold:
                return
            log.info("preempting request %s (priority %d) for request %s (priority %d)",
                     victim.rid, victim.priority, first.rid, first.priority)
            self._retract(victim)
            self.stats.preemptions += 1

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
        firsts = [logits_from(e) for e in extends]
        ends = [e.req.kv_len + e.length for e in extends]
        images, attend_until = extend_images(extends, self.bidirectional_images)
        step = ForwardStep(
            mode=ForwardMode.EXTEND,
            input_ids=[t for e in extends for t in e.req.fill_ids[e.req.kv_len : e.req.kv_len + e.length]],
            q_lens=[e.length for e in extends],
            kv_lens=ends,
            kv_indices=self.kv.contexts([e.req for e in extends], ends),
            logits_from=firsts,
            lora_slots=self.lora_slots([e.req for e in extends]),
            images=images,
            attend_until=attend_until,
        )
        if any(e.req.embed and e.completes for e in extends):
            logits, hidden = self.runner.forward_with_hidden(step)
        else:
            logits, hidden = self.runner.forward(step), None
        if self.speculative is not None:
            self.speculative.mirror(step)
        to_sample: list[Req] = []
        last_rows: list[torch.Tensor] = []
        offset = 0
        self.chunked = None
        for ext, first in zip(extends, firsts, strict=True):
            req, rows = ext.req, logits[offset : offset + ext.length - first]
            offset += ext.length - first
            if req.embed and ext.completes:
                req.embedding = torch.nn.functional.normalize(hidden[offset - 1].float(), dim=0).tolist()
            if req.wants_input_logprobs:
                record_input_logprobs(req, rows, req.kv_len + first)
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
        batch = self.decode_plain() if self.speculative is None else self.speculative.decode(self)
        self.ratio = max(self.config.min_new_token_ratio, self.ratio - self.config.new_token_ratio_decay)
        return batch

    def decode_plain(self, timed: Callable[[float], None] | None = None) -> list[Req]:
        """The plain decode step: one token for every running request, whose pending tokens
        have room reserved. A request with jump-forward tokens pending feeds them all in the
        same step (the step then runs in extend mode). Also the speculative step's, where
        no request drafts: `timed` is given the seconds of the pass and the draw (what a
        verification pass is timed by), before any token is emitted."""
        batch = list(self.running)
        pending = [r.seq_len - r.kv_len for r in batch]
        mode = ForwardMode.DECODE if max(pending) == 1 else ForwardMode.EXTEND
        ends = [r.kv_len + n for r, n in zip(batch, pending, strict=True)]
        step = ForwardStep(
            mode=mode,
            input_ids=[t for r in batch for t in r.pending_ids()],
            q_lens=pending,
            kv_lens=ends,
            kv_indices=self.kv.contexts(batch, ends),
            logits_from=[n - 1 for n in pending],
            lora_slots=self.lora_slots(batch),
        )
        start = time.perf_counter()
        logits = self.runner.forward(step)
        if self.speculative is not None:
            self.speculative.mirror(step)
        for r, n in zip(batch, pending, strict=True):
            r.kv_len += n
        self._sample(batch, logits, None if timed is None else lambda: timed(time.perf_counter() - start))
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

    def _retract(self, req: Req, why: str = "to free KV slots") -> None:
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
            req.input_token_ids_logprobs.clear()
        self.kv.release(req)
        req.retractions += 1
        self.waiting.append(req)
        self.stats.retractions += 1
        self.ratio = self.config.new_token_ratio
        log.info("retracted request %s (%d tokens generated) %s", req.rid, len(req.output_ids), why)

    # ------------------------------------------------------------------ sampling and stopping
    def _sample(self, reqs: list[Req], logits: torch.Tensor, drawn_hook: Callable[[], None] | None = None) -> None:
        """Draw a token for each of `reqs` from its row of `logits` and emit it; `drawn_hook`
        runs after the draw, before any token is emitted."""
        drawn = self.draw(reqs, logits, [r.output_ids for r in reqs])
        if drawn_hook is not None:
            drawn_hook()
        for b, req in enumerate(reqs):
            self.emit(req, drawn, b)

    def draw(self, reqs: list[Req], logits: torch.Tensor, outputs: list[list[int]],
             bitmasks: list[torch.Tensor | None] | None = None) -> Drawn:
        """Sample row b of `logits` for `reqs[b]` as if it had generated `outputs[b]` so far
        (a request may fill several rows: speculative verification, which gives the
        grammar masks of a constrained request's rows, `bitmasks`)."""
        return draw_tokens(reqs, logits, outputs, self.eos_ids, self.grammars, self.runner.generator, bitmasks)

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
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(list(zip(drawn.picked[b], req.token_ids_logprob, strict=True)))
        self._check_stop(req, token)

    def _check_stop(self, req: Req, token: int) -> None:
        reason = self.stops.after_token(req, token)
        if reason is None and req.grammar is not None and self.config.enable_jump_forward and not req.return_logprob:
            jumped, reason = self.stops.jump_forward(req)
            self.stats.jump_forward_tokens += jumped
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish = reason
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)

    # ------------------------------------------------------------------ outputs
    def _collect(self, req: Req) -> TokenOutput:
        sent_ids, sent_input = self._sent.get(req.rid, (0, False))
        out = collect_output(req, sent_ids, sent_input, self.stops.take_text(req))
        if req.finished:
            self._reqs.pop(req.rid, None)
            self._sent.pop(req.rid, None)
            self.stops.forget(req.rid)
        else:
            self._sent[req.rid] = (len(req.output_ids), sent_input or out.input_logprobs is not None)
        return out
