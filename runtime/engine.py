"""The offline engine: the scheduler and the model runner in this process, no sockets.

    from sprig.runtime import Engine
    with Engine(model_path="path/to/checkpoint", dtype="float32") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        out = await engine.async_generate(...)  # from many coroutines at once: they batch

Outputs follow SGLang's `/generate` response schema.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from sprig.runtime.distributed.runner import make_runner
from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.engine_driver import EngineDriver, add_all
from sprig.runtime.engine_weights import EngineWeights
from sprig.runtime.label_scores import SCORE_SAMPLING, score_call
from sprig.runtime.multimodal.media import MediaLimits
from sprig.runtime.multimodal.prompts import load_prompter, prompts_with_images
from sprig.runtime.request_contract import (
    PRIORITY_OFF,
    InvalidRequest,
    LogprobOptions,
    ModelLimits,
    SamplingArg,
    TokenizedRequest,
    build_embedding_requests,
    build_requests,
    prompt_rows,
)
from sprig.runtime.response import ResponseBuilder
from sprig.runtime.scheduler.intake import RequestRejected
from sprig.runtime.scheduler.request import Req
from sprig.runtime.scheduler.scheduler import Scheduler
from sprig.runtime.tokenizer import load_tokenizer

Prompt = str | list[str] | None
ENGINE_LOG_LEVELS = ("debug", "info", "warning", "error")


class Engine(EngineWeights):
    """Generation on one model in this process. `generate` runs one call at a time and is
    not thread-safe; `async_generate` serves any number of concurrent calls from one event
    loop at a time, batched together. The two do not mix: `generate` refuses to run while
    async calls are in flight.

    Keyword arguments are `RunnerConfig`, `SchedulerConfig` and `DistConfig` fields (dtype,
    device, attention_backend, page_size, max_total_tokens, chunked_prefill_size,
    schedule_policy, disable_radix_cache, tp_size, ...). Every request that `generate` starts is
    finished or aborted when it returns, so the KV invariant holds between calls.

    The weights' calls (`update_weights_from_disk`, `update_weights_from_tensor`, the
    weight-update group's, `get_weights_by_name`) are `EngineWeights`'.

    Two of SGLang's `Engine` keywords that its programs pass as a habit are taken too:
    `log_level` ("debug", "info", "warning" or "error") sets the level of sprig's loggers in
    this process, and `trust_remote_code` changes nothing, since sprig runs no code from a
    checkpoint (one whose model needs its own code is refused by its architecture).
    """

    def __init__(self, model_path: str | None = None, *, log_level: str | None = None,
                 trust_remote_code: bool = False, **kwargs: Any) -> None:
        if log_level is not None:
            if log_level not in ENGINE_LOG_LEVELS:
                raise ValueError(f"log_level must be one of {list(ENGINE_LOG_LEVELS)}, got {log_level!r}")
            logging.getLogger("sprig").setLevel(log_level.upper())
        if model_path is None:  # sprig's embedded demo model
            from sprig.runtime.demo import ensure_demo_model

            model_path = str(ensure_demo_model())
        self.config = EngineConfig.from_kwargs(str(model_path), **kwargs)
        self.tokenizer = load_tokenizer(model_path)
        self.runner = make_runner(self.config.runner, self.config.dist,
                                  draft_model_path=self.config.scheduler.speculative_draft_model_path)
        self.scheduler = Scheduler(self.config.scheduler, self.runner, self.tokenizer)
        self._ids = itertools.count()
        self.images, self._no_images = load_prompter(model_path, self.runner.model_config.image, self.tokenizer,
                                                     MediaLimits(allowed_local_dir=Path("/")), self.runner.no_images)
        self.limits = ModelLimits(self.scheduler.context_len, self.scheduler.vocab_size,
                                  None if self.images is None else self.images.spec.token_id)
        self._driver = EngineDriver(self.scheduler)
        self._sync_calls = 0  # `generate` calls stepping the scheduler on the caller's thread

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        token_ids_logprob: int | list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a batch (a list, n outputs per prompt in
        order). `stream=True` returns an iterator of partial outputs with cumulative text,
        the last of each sequence's final (in a batch, or with `n > 1`, each with its place
        among the outputs as "index"). `return_logprob`, `logprob_start_len` and
        `top_logprobs_num` each take one value for every prompt or a list with one per
        prompt; with `return_logprob`, `token_ids_logprob` (ids, or a list of ids per
        prompt) adds those tokens' logprobs at each position, as SGLang's does
        (`LogprobOptions.per_prompt`). `priority` ranks the call's requests where the
        engine schedules by priority (`enable_priority_scheduling`; refused otherwise).
        `lora_path` names the loaded LoRA adapter the prompts run with (or one name, or
        None for the base model, per prompt), as SGLang's does. `image_data` gives a
        vision-language model's prompts their images, as SGLang's does: one image or a list
        for one prompt, a list with one entry (None, an image or a list) per prompt for a
        batch; an image is a PIL image, a file path, a data URL, base64 or an http(s) URL,
        and each goes where the prompt holds the model's begin-of-image token (Gemma 3:
        `<start_of_image>`). An invalid argument raises
        `InvalidRequest` (a `ValueError`) naming it: the checks are
        the server's (`request_contract`)."""
        if self._driver.busy:
            raise RuntimeError("Engine.generate cannot run while async_generate calls are in flight: "
                               "await them first, or use async_generate")
        self._driver.call(lambda: None)  # the worker thread may still be retiring what async calls left
        batch, reqs, builder = self._prepare(prompt, input_ids, sampling_params, rid, stream, priority, lora_path,
                                             image_data, return_logprob, logprob_start_len, top_logprobs_num,
                                             return_text_in_logprobs, token_ids_logprob)
        updated = self._run(reqs, builder, partial=stream)
        if stream:
            return (builder.partial(rid) for rid in updated)
        for _ in updated:
            pass
        outs = builder.responses()
        return outs if batch or len(outs) > 1 else outs[0]

    async def async_generate(
        self,
        prompt: Prompt = None,
        sampling_params: SamplingArg = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        token_ids_logprob: int | list[int] | list[list[int]] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` for many concurrent callers, as SGLang's `Engine.async_generate`: the
        requests of every call in flight run in one batch, and each call's outputs equal
        what `generate` returns for it. With `stream=True` it returns an async iterator of
        partial outputs (cumulative text; the last is final), whose requests start when
        iteration does. A call cancelled, or a stream closed, before its end aborts its
        requests and frees their KV slots. Invalid arguments raise as in `generate`."""
        if self._sync_calls:
            raise RuntimeError("Engine.async_generate cannot run while a generate stream is being read: "
                               "finish or close it first")
        batch, reqs, builder = self._prepare(prompt, input_ids, sampling_params, rid, stream, priority, lora_path,
                                             image_data, return_logprob, logprob_start_len, top_logprobs_num,
                                             return_text_in_logprobs, token_ids_logprob)
        if stream:
            return self._stream(reqs, builder)
        async for _ in self._driver.run(reqs, builder):
            pass
        outs = builder.responses()
        return outs if batch or len(outs) > 1 else outs[0]

    def encode(self, prompt: Prompt = None, input_ids: list[int] | list[list[int]] | None = None, *,
               rid: str | list[str] | None = None,
               lora_path: str | list[str | None] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `Engine.encode`: the embedding of one prompt (a dict back) or of each of
        a batch (a list), `{"embedding": [...], "meta_info": {...}}`. The embedding is the
        final-norm hidden state of the prompt's last token, L2-normalized (last-token
        pooling, as causal embedding models such as Qwen3-Embedding and e5-mistral pool);
        the prompt's KV joins the radix cache like any prompt's. `lora_path` names a loaded
        LoRA adapter, as in `generate`. Invalid arguments raise `InvalidRequest` naming
        them."""
        if self._driver.busy:
            raise RuntimeError("Engine.encode cannot run while async_generate calls are in flight: "
                               "await them first, or use async_encode")
        self._driver.call(lambda: None)  # the worker thread may still be retiring what async calls left
        batch, reqs, builder = self._prepare_embedding(prompt, input_ids, rid, lora_path)
        for _ in self._run(reqs, builder, partial=False):
            pass
        outs = builder.responses()
        return outs if batch else outs[0]

    async def async_encode(self, prompt: Prompt = None, input_ids: list[int] | list[list[int]] | None = None, *,
                           rid: str | list[str] | None = None,
                           lora_path: str | list[str | None] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """`encode` for concurrent callers, batched with every async call in flight."""
        if self._sync_calls:
            raise RuntimeError("Engine.async_encode cannot run while a generate stream is being read: "
                               "finish or close it first")
        batch, reqs, builder = self._prepare_embedding(prompt, input_ids, rid, lora_path)
        async for _ in self._driver.run(reqs, builder):
            pass
        outs = builder.responses()
        return outs if batch else outs[0]

    def score(self, query: str | list[int] | None = None, items: str | list[str] | list[list[int]] | None = None,
              label_token_ids: list[int] | None = None, apply_softmax: bool = False,
              item_first: bool = False) -> list[list[float]]:
        """SGLang's `Engine.score`: for each item, the probability of each label token as the
        next token after `query + item` (`item + query` with `item_first`), in the order of
        `label_token_ids`; with `apply_softmax`, renormalized over the labels (each row then
        sums to 1). `query` and `items` are both text or both token ids
        (`sprig.runtime.label_scores`). Invalid arguments raise `InvalidRequest` naming them."""
        call = score_call(query, items, label_token_ids, apply_softmax, item_first, limits=self.limits,
                          encode=self.tokenizer.encode)
        return call.scores(self.generate(input_ids=call.prompts, sampling_params=SCORE_SAMPLING,
                                         return_logprob=True, token_ids_logprob=list(call.labels)))

    async def async_score(self, query: str | list[int] | None = None,
                          items: str | list[str] | list[list[int]] | None = None,
                          label_token_ids: list[int] | None = None, apply_softmax: bool = False,
                          item_first: bool = False) -> list[list[float]]:
        """`score` for concurrent callers, batched with every `async_generate` call in flight."""
        call = score_call(query, items, label_token_ids, apply_softmax, item_first, limits=self.limits,
                          encode=self.tokenizer.encode)
        return call.scores(await self.async_generate(input_ids=call.prompts, sampling_params=SCORE_SAMPLING,
                                                     return_logprob=True, token_ids_logprob=list(call.labels)))

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing done) while requests are in flight."""
        return not self._driver.busy and self._driver.call(self.scheduler.flush_cache)

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load the PEFT LoRA adapter at `lora_path` under `lora_name`, as SGLang's does:
        `{"success", "error_message", "loaded_adapters": {name: path}}`. Later requests may
        name it in `lora_path`. On failure nothing changes and `error_message` says why (not
        an adapter, not enabled, the name taken, no free slot, layers or rank it does not
        fit). Every loaded adapter stays loaded until unloaded (`pinned` changes nothing)."""
        return self._lora_call(lambda: self.scheduler.load_lora_adapter(lora_name, str(lora_path)))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload adapter `lora_name` and drop the prefixes cached with it; the same answer
        as `load_lora_adapter`. Refused while a request in flight uses it."""
        return self._lora_call(lambda: self.scheduler.unload_lora_adapter(lora_name))

    def _lora_call(self, change: Callable[[], None]) -> dict[str, Any]:
        error = None
        try:
            self._driver.call(change)
        except ValueError as e:
            error = str(e)
        return {"success": error is None, "error_message": error,
                "loaded_adapters": self._driver.call(self.scheduler.lora_adapters)}

    def check_integrity(self) -> None:
        """The KV invariants (`Scheduler.check_integrity`), checked between scheduler steps."""
        self._driver.call(self.scheduler.check_integrity)

    def shutdown(self) -> None:
        """Abort every request and free the model, its KV pool and the grammar compile
        worker processes."""
        self._driver.close()
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort(req.rid)
        self.scheduler.close()
        on_cuda = self.runner is not None and self.runner.device.type == "cuda"
        if self.runner is not None:
            self.runner.weight_groups.close()  # rank 0's (the other ranks close theirs as they stop)
            self.runner.close()
        self.scheduler = None
        self.runner = None
        if on_cuda:  # hand the KV pool's memory back to the driver, for other processes
            gc.collect()
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _prepare(self, prompt: Prompt, input_ids: Any, sampling_params: SamplingArg, rid: Any, stream: bool,
                 priority: int | None, lora_path: Any, image_data: Any,
                 *logprob_options: Any) -> tuple[bool, list[Req], ResponseBuilder]:
        """(is_batch, the call's requests, their response builder), every check done."""
        if priority is not None and not self.config.scheduler.enable_priority_scheduling:
            raise InvalidRequest(PRIORITY_OFF, "priority")
        field = "prompt" if prompt is not None else "input_ids"
        if image_data is None:
            batch, prompts = prompt_rows(prompt, input_ids, self.tokenizer.encode, text_field="prompt")
            images = None
        else:
            if self.images is None:
                raise InvalidRequest(self._no_images, "image_data")
            batch, prompts, images = prompts_with_images(self.images, prompt, input_ids, image_data,
                                                         self.tokenizer.encode, param=field)
        logprobs = LogprobOptions.per_prompt(len(prompts), *logprob_options)
        requests = build_requests(
            prompts, sampling_params, self.limits, rid=rid, logprobs=logprobs, stream=stream,
            new_rid=self._new_rid, prompt_field=field, priority=priority, lora_path=lora_path, images=images,
        )
        self._check_adapters(requests)
        reqs = [Req.of(r) for r in requests]
        builder = ResponseBuilder(self.tokenizer, reqs, return_text_in_logprobs=logprobs[0].return_text_in_logprobs,
                                  stream=stream, indexed=batch or len(reqs) > 1)
        return batch, reqs, builder

    def _prepare_embedding(self, prompt: Prompt, input_ids: Any, rid: Any,
                           lora_path: Any) -> tuple[bool, list[Req], ResponseBuilder]:
        batch, prompts = prompt_rows(prompt, input_ids, self.tokenizer.encode, text_field="prompt")
        requests = build_embedding_requests(prompts, self.limits, rid=rid, new_rid=self._new_rid,
                                            prompt_field="prompt" if prompt is not None else "input_ids",
                                            lora_path=lora_path)
        self._check_adapters(requests)
        reqs = [Req.of(r) for r in requests]
        return batch, reqs, ResponseBuilder(self.tokenizer, reqs, stream=False)

    def _check_adapters(self, requests: list[TokenizedRequest]) -> None:
        """`InvalidRequest` naming `lora_path` unless every adapter the requests name is
        loaded (a look-up only: the scheduler checks again when it takes them)."""
        for name in {r.lora_path for r in requests} - {None}:
            try:
                self.scheduler.lora_slot(name)
            except RequestRejected as e:
                raise InvalidRequest(str(e), "lora_path") from None

    def _new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    async def _stream(self, reqs: list[Req], builder: ResponseBuilder) -> AsyncIterator[dict[str, Any]]:
        async for rid in self._driver.run(reqs, builder):
            yield builder.partial(rid)

    def _submit(self, reqs: list[Req]) -> None:
        try:
            add_all(self.scheduler, reqs)
        except Exception:
            while self.scheduler.has_work:
                self.scheduler.step()
            raise

    def _run(self, reqs: list[Req], builder: ResponseBuilder, *, partial: bool) -> Iterator[str]:
        """Add `reqs`, then step the scheduler until every one is finished, yielding the
        id of each request whose response just grew (callers snapshot only if streaming);
        without `partial`, a response grows once, when its request finishes. Nothing runs
        until the first `next()`: a stream never read leaves nothing in the scheduler."""
        self._submit(reqs)
        start = time.monotonic()
        pending = {r.rid for r in reqs}
        self._sync_calls += 1
        try:
            while pending:
                for out in self.scheduler.step(partial=partial):
                    if out.rid in pending:
                        builder.add(out, time.monotonic() - start)
                        if out.finish_reason is not None:
                            pending.discard(out.rid)
                        yield out.rid
        finally:
            for rid in pending:
                self.scheduler.abort(rid)
            while self.scheduler.has_work:
                self.scheduler.step()
            self._sync_calls -= 1
