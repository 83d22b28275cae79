"""The offline engine: the scheduler and the model runner in this process, no sockets.

    from sprig.runtime import Engine
    with Engine(model_path="path/to/checkpoint", dtype="float32") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})

Outputs follow SGLang's `/generate` response schema.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.response import ResponseBuilder
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler import Req, Scheduler
from sprig.runtime.tokenizer import load_tokenizer

Prompt = str | list[str] | None
SamplingArg = dict[str, Any] | SamplingParams | Sequence[dict[str, Any] | SamplingParams] | None


class Engine:
    """Generation on one model in this process. Not thread-safe: one call at a time.

    Keyword arguments are `RunnerConfig` and `SchedulerConfig` fields (dtype, device,
    attention_backend, page_size, max_total_tokens, chunked_prefill_size,
    schedule_policy, disable_radix_cache, ...). Every request that `generate` starts is
    finished or aborted when it returns, so the KV invariant holds between calls.
    """

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model_path), **kwargs)
        self.tokenizer = load_tokenizer(model_path)
        self.runner = ModelRunner(self.config.runner)
        self.scheduler = Scheduler(self.config.scheduler, self.runner, self.tokenizer)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingArg = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a batch (a list, n outputs per prompt in
        order). `stream=True` returns an iterator of partial outputs with cumulative text,
        the last of which is final. An invalid argument raises `ValueError` naming it."""
        batch, prompts = self._prompts(prompt, input_ids)
        params = self._params(sampling_params, len(prompts))
        rids = self._rids(rid, len(prompts))
        reqs = [
            Req(
                rid=f"{rids[i]}-{j}" if p.n > 1 else rids[i],
                prompt_ids=ids,
                params=replace(p, seed=None if p.seed is None else p.seed + j),
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
            )
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
            for j in range(p.n)
        ]
        builder = ResponseBuilder(self.tokenizer, reqs, return_text_in_logprobs=return_text_in_logprobs)
        self._submit(reqs)
        events = self._run(reqs, builder)
        if stream:
            return events
        for _ in events:
            pass
        outs = builder.responses()
        return outs if batch or len(outs) > 1 else outs[0]

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing done) while requests are in flight."""
        return self.scheduler.flush_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid)
        self.scheduler = None
        self.runner = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _prompts(self, prompt: Prompt, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) and input_ids")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            return not isinstance(prompt, str), [self.tokenizer.encode(t) for t in texts]
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of ints or of lists of ints")
        batch = isinstance(input_ids[0], list)
        rows = input_ids if batch else [input_ids]
        for row in rows:
            if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        return batch, [list(r) for r in rows]

    @staticmethod
    def _params(arg: SamplingArg, n: int) -> list[SamplingParams]:
        def one(p: dict[str, Any] | SamplingParams | None) -> SamplingParams:
            return p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)

        if isinstance(arg, list | tuple):
            if len(arg) != n:
                raise ValueError(f"sampling_params has {len(arg)} entries for {n} prompts")
            return [one(p) for p in arg]
        return [one(arg)] * n

    def _rids(self, rid: str | list[str] | None, n: int) -> list[str]:
        if rid is None:
            return [f"{uuid.uuid4().hex[:12]}-{next(self._ids)}" for _ in range(n)]
        rids = [rid] if isinstance(rid, str) else list(rid)
        if len(rids) != n:
            raise ValueError(f"rid has {len(rids)} entries for {n} prompts")
        return rids

    def _submit(self, reqs: list[Req]) -> None:
        added: list[Req] = []
        try:
            for req in reqs:
                self.scheduler.add_request(req)
                added.append(req)
        except Exception:
            for req in added:
                self.scheduler.abort(req.rid)
            while self.scheduler.has_work:
                self.scheduler.step()
            raise

    def _run(self, reqs: list[Req], builder: ResponseBuilder) -> Iterator[dict[str, Any]]:
        """Step the scheduler until every request of this call is finished."""
        start = time.monotonic()
        pending = {r.rid for r in reqs}
        try:
            while pending:
                for out in self.scheduler.step():
                    if out.rid in pending:
                        builder.add(out, time.monotonic() - start)
                        if out.finish_reason is not None:
                            pending.discard(out.rid)
                        yield builder.partial(out.rid)
        finally:
            for rid in pending:
                self.scheduler.abort(rid)
            while self.scheduler.has_work:
                self.scheduler.step()
