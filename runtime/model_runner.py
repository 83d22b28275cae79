"""The model runner: owns the model, the KV pool and every device tensor; the scheduler
calls `forward(ForwardStep)` once per step and gets float32 logits back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import torch

from sprig.radix.kv_cache import KV_CACHE_DTYPES, KVCache, KVShape, slots_for_budget
from sprig.runtime.attention import default_backend, make_backend
from sprig.runtime.cpu_matmul import matmul_slowdown
from sprig.runtime.cuda_graph import DecodeGraphs
from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.shard import ShardPlan
from sprig.runtime.distributed.step_message import send_lora, send_weight_group
from sprig.runtime.distributed.weight_sync import WeightGroups
from sprig.runtime.forward_step import EncodedImages, ForwardStep, build_forward_batch
from sprig.runtime.lora.manager import ALONE, LoRAManager, RankSync
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import supported_architectures
from sprig.runtime.multimodal.inputs import TEXT_ONLY
from sprig.runtime.quantization.formats import OnlineFormat
from sprig.runtime.runner_config import DTYPES, RunnerConfig
from sprig.runtime.weight_loader import (
    load_model,
    load_named_tensors,
    load_weights,
    named_tensor,
    parameter_count,
)
from sprig.runtime.weight_update import WeightUpdateError, check_weight_values

CPU_DEFAULT_TOKENS = 16384  # KV pool on CPU when max_total_tokens is not given: these tokens' float bytes ...
CPU_KV_BUDGET_BYTES = 1 << 30  # ... unless fewer tokens fit in this many bytes
CPU_SLOW_HALF = 2.0  # on CPU, a half dtype this many times slower than float32 at a matmul gets a warning
CUDA_CPU_THREADS = 1  # torch's CPU threads when the model runs on CUDA and cpu_threads is None
log = logging.getLogger(__name__)


class ModelRunner:
    """One model on one device, with its KV pool.

    `kv_cache` has `num_slots` usable slots, `page_size .. page_size + num_slots - 1`
    (a multiple of `page_size`); the first page is padding. `generator` is the seeded RNG
    samplers draw from. Not thread-safe: one step at a time. With a tensor-parallel group
    `tp` it is one rank's runner: its part of the model and of the KV pool (its KV heads, at
    the same slots as every rank's), and every rank must run the same steps in order.
    `draft_model_path` names a draft model that will run beside this one (speculative
    decoding) with a KV pool of the same slots in the same storage: a CUDA pool sized by
    `mem_fraction_static` then leaves room in that fraction for the draft's weights and
    its pool.
    `weight_groups` receives weights a trainer broadcasts (`weight_sync`).
    """

    def __init__(self, config: RunnerConfig, tp: TPGroup | None = None, *,
                 draft_model_path: str | None = None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(
            config.model_path, context_length=config.context_length, supported=supported_architectures()
        )
        self.no_images = "" if self.model_config.image is not None else TEXT_ONLY
        self.device = _resolve_device(config.device)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        elif self.device.type == "cuda":
            torch.set_num_threads(CUDA_CPU_THREADS)
        self.dtype = _resolve_dtype(config.dtype, self.model_config)
        float_weights = config.quantization is None and self.model_config.quantization is None
        if self.device.type == "cpu" and self.dtype != torch.float32 and float_weights:
            _warn_if_slow_on_cpu(self.dtype)
        self.model = load_model(
            self.model_config, Path(config.model_path), dtype=self.dtype, device=self.device,
            quantization=None if config.quantization is None
            else OnlineFormat.of(config.quantization, config.quantization_group_size),
            tp=tp,
        )
        local = self.model_config if tp is None else ShardPlan(self.model_config, tp.rank, tp.size).local_config()
        shape = KVShape(
            local.num_layers, local.num_kv_heads,
            local.head_dim, self.dtype, _kv_storage(config.kv_cache_dtype, self.device),
        )
        slots = _num_slots(config, shape, self.device, draft_model_path, self.model_config.context_len)
        self.kv_cache = KVCache(
            shape, slots if tp is None else tp.min_int(slots), page_size=config.page_size,
            device=self.device,
        )
        self.attention_backend = (
            default_backend(self.device.type)
            if config.attention_backend == "auto"
            else config.attention_backend
        )
        self.backend = make_backend(
            self.attention_backend, local, self.kv_cache, shadow=config.shadow_attention
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.random_seed)
        self.tp = tp
        self.lora = self._lora(config)
        self.graphs = self._new_graphs()
        self.weight_groups = WeightGroups(
            self.model, self.model_config, self.device, quantized=not float_weights, tp=tp,
            announce=partial(send_weight_group, tp) if tp is not None and tp.rank == 0 else None,
        )

    @property
    def takes_images(self) -> bool:
        """Whether steps may carry images (`ForwardStep.images`): the model has an image
        encoder (else `no_images` says why requests with images are refused). Under tensor
        parallelism every rank holds the whole encoder (it is not split), and rank 0 alone
        runs it: `encode_images`, whose embeddings the other ranks receive with the step."""
        return self.model_config.image is not None

    def encode_images(self, step: ForwardStep) -> ForwardStep:
        """`step` with its images' pixels replaced by their embeddings (`ForwardStep.encoded`,
        on this runner's device), which `forward` then merges as it would have computed
        them; `step` itself when it has no images for this model to encode."""
        if not step.images or not self.takes_images:
            return step
        with torch.inference_mode():
            rows, embeds = self._image_embeddings(step)
        return replace(step, images=[], encoded=EncodedImages(rows, embeds))

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def close(self) -> None:
        """Release what the runner holds beyond its tensors: its weight-update groups (a
        tensor-parallel runner also stops its other ranks)."""
        self.weight_groups.close()

    def forward(self, step: ForwardStep) -> torch.Tensor:
        """Run one step; returns float32 logits `[sum(q_len - logits_from), vocab]` on the
        runner's device, rows in request order (within a request, token order).

        Writes the new tokens' K/V into their slots (the last q_len of each request's
        context in kv_indices); the slots of the cached prefix must already hold that
        prefix's K/V.
        """
        self._check_context(step)
        bucket = self.graphs.bucket(step) if self.graphs is not None else None
        if bucket is not None:
            with torch.inference_mode():
                hidden = self.graphs.run(step, bucket)  # [B, H]: decode has one row each
                return self.model.compute_logits(hidden)
        return self._eager(step)[0]

    def forward_with_hidden(self, step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits and the final-norm hidden states they came from, `[R, H]`
        (the same rows; run eagerly, as extend steps always are)."""
        self._check_context(step)
        return self._eager(step)

    def update_weights(self, path: str, agree: Callable[[bool], bool] = bool) -> None:
        """Load the weights of the checkpoint at `path` into the model, in place, and make
        `path` the runner's `config.model_path`; the KV pool is untouched, so the caller
        drops every cached prefix (K/V computed with the old weights).

        The checkpoint must describe the same model (`check_same_model`); its dtype may
        differ (weights convert to the runner's). `agree(ok)` says whether every rank
        loaded its part (tensor parallelism: all ranks take the new weights, or all keep
        the old). If not, a rank that had begun loading reloads the previous checkpoint
        and `WeightUpdateError` (a ValueError) says why; a reload that fails too leaves
        the model unusable and raises RuntimeError. CUDA graphs are captured again on
        next use (a quantized layer's tensors are rebuilt by a load)."""
        error: Exception | None = None
        touched = False
        try:
            check_same_model(self.model_config, self._read_config(path), path)
            touched = True
            self._load(path)
        except Exception as e:  # any failure to load: the previous weights go back in place
            error = e
        if agree(error is None):
            self.config = replace(self.config, model_path=str(path))
            log.info("loaded new weights from %s", path)
            return
        if touched:
            try:
                self._load(self.config.model_path)
            except Exception as e:
                raise RuntimeError(f"restoring the weights of {self.config.model_path} after a failed update "
                                   f"failed too: {e}") from e
        reason = "another tensor-parallel rank could not load them" if error is None else error
        raise WeightUpdateError(f"the weights at {path} were not loaded ({reason}); the weights of "
                                f"{self.config.model_path} are in place") from error

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy `(checkpoint name, tensor)` pairs into the model's float weights, in place
        (`weight_loader.load_named_tensors`): any subset of them, in any float dtype, on
        any device; returns how many were copied. `WeightUpdateError` if one does not fit
        (checked before any is copied) or the model is split over tensor-parallel ranks.
        As with `update_weights`, the caller drops every cached prefix; CUDA graphs stay
        valid (they read the same tensors)."""
        if self.tp is not None:
            raise WeightUpdateError("weights split over tensor-parallel ranks are updated from a checkpoint on disk")
        try:
            return load_named_tensors(self.model, tensors)
        except ValueError as e:
            raise WeightUpdateError(f"no weight was updated: {e}") from None

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the float weight a checkpoint names `name`
        (float32 values as nested lists), as SGLang's does: for checking that a weight
        update arrived. ValueError for an unknown or quantized name, more values than
        `weight_update.MAX_WEIGHT_VALUES`, or a model split over tensor-parallel ranks
        (each holds a part)."""
        if self.tp is not None:
            raise ValueError("weights split over tensor-parallel ranks are not read back (each rank holds a part)")
        rows = named_tensor(self.model, name)[:truncate_size]
        check_weight_values(len(rows), rows.numel())
        return rows.float().cpu().tolist()

    def _read_config(self, path: str) -> ModelConfig:
        return ModelConfig.from_pretrained(path, context_length=self.config.context_length,
                                           supported=supported_architectures())

    def _load(self, path: str | Path) -> None:
        load_weights(self.model, path, dtype=self.dtype, device=self.device)
        self.graphs = self._new_graphs()

    def _lora(self, config: RunnerConfig) -> LoRAManager | None:
        """The LoRA manager, if LoRA is on. Under tensor parallelism each rank's holds its
        part of every adapter; rank 0's announces each load and unload to the others (the
        rank loop applies them) and every load is agreed by all ranks."""
        if not config.lora:
            return None
        sync = ALONE
        if self.tp is not None:
            sync = RankSync(agree=self.tp.all_agree, announce=partial(send_lora, self.tp) if self.tp.rank == 0 else None)
        lora = LoRAManager(self.model, paths=config.lora_adapters(), slots=config.max_loras_per_batch,
                           max_rank=config.max_lora_rank, target_modules=config.lora_target_modules,
                           dtype=self.dtype, device=self.device, sync=sync)
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            log.info("LoRA: decode runs without CUDA graphs")
        return lora

    def _new_graphs(self) -> DecodeGraphs | None:
        """Decode graphs (captured lazily, per batch size) where they apply, else None."""
        config = self.config
        if (self.device.type != "cuda" or not self.backend.supports_cuda_graph or self.tp is not None
                or config.disable_cuda_graph or config.shadow_attention or self.lora is not None):
            return None
        return DecodeGraphs(self.model, self.backend, self.kv_cache, max_bs=config.cuda_graph_max_bs,
                            context_len=self.model_config.context_len, device=self.device)

    def _check_context(self, step: ForwardStep) -> None:
        longest = max(step.kv_lens)
        if longest > self.model_config.context_len:
            raise ValueError(
                f"a context of {longest} tokens exceeds the model's context_len "
                f"{self.model_config.context_len}"
            )

    def _eager(self, step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        batch, logit_rows = build_forward_batch(step, self.kv_cache, self.device)
        with torch.inference_mode():
            encoded = step.encoded  # (a text draft model mirrors image steps on placeholders: none to encode)
            if encoded is None and step.images and self.takes_images:
                encoded = EncodedImages(*self._image_embeddings(step))
            if encoded is not None:
                batch.image_rows, batch.image_embeds = encoded.rows.to(self.device), encoded.embeds.to(self.device)
            self.backend.begin_step(batch)
            if self.lora is not None:
                self.lora.tokens.slots = batch.lora_slots
            try:
                hidden = self.model(batch, self.backend)[logit_rows]  # [R, H]
            finally:
                if self.lora is not None:
                    self.lora.tokens.slots = None
            return self.model.compute_logits(hidden), hidden  # [R, V], [R, H]

    def _image_embeddings(self, step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `step`'s new tokens that take image embeddings (`[M]` int64, CPU), and
        those embeddings (`[M, H]`, on the device): every image of the step encoded in one batch."""
        pixels = torch.stack([im.pixels for im in step.images]).to(self.device, self.dtype)
        encoded = self.model.encode_images(pixels)  # [N, tokens_per_image, H]
        rows = torch.cat([torch.arange(im.row, im.row + im.count) for im in step.images])
        embeds = torch.cat([e[im.first : im.first + im.count] for e, im in zip(encoded, step.images, strict=True)])
        return rows, embeds


def check_same_model(served: ModelConfig, new: ModelConfig, path: str | Path) -> None:
    """ValueError naming every config field (other than the checkpoint's dtype) in which
    the checkpoint at `path` differs from the served model's: a weight update keeps the
    model's shape, its rope, its end tokens and its quantization."""
    changed = [f.name for f in fields(ModelConfig)
               if f.name != "torch_dtype" and getattr(served, f.name) != getattr(new, f.name)]
    if changed:
        detail = ", ".join(f"{name} {getattr(served, name)!r} -> {getattr(new, name)!r}" for name in changed)
        raise ValueError(f"{Path(path) / 'config.json'} describes another model than the one served ({detail})")


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def _resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    checkpoint = model_config.torch_dtype or "float32"
    if checkpoint not in DTYPES:
        raise ValueError(
            f"the checkpoint's dtype {checkpoint!r} is not supported; pass one of {list(DTYPES)}"
        )
    return getattr(torch, checkpoint)


def _warn_if_slow_on_cpu(dtype: torch.dtype) -> None:
    """Log a warning when this CPU multiplies `dtype` over `CPU_SLOW_HALF` times slower than
    float32 (AVX2-only CPUs and bfloat16), measured at a prefill's shape: float weights'
    prefills and batched decode then run several times slower than with dtype float32.
    (Quantized weights run other kernels, which want half activations: not timed.)"""
    slowdown = matmul_slowdown(dtype, 64, 1024, 1024)
    if slowdown > CPU_SLOW_HALF:
        name = str(dtype).removeprefix("torch.")
        log.warning("running in %s on a CPU without a fast %s matmul (%.0fx float32's time at a 64-token "
                    "prefill's shape): prefills and batched decode will be several times slower than with "
                    "dtype float32 (--dtype float32), which holds the weights at twice the bytes",
                    name, name, slowdown)


def _kv_storage(name: str, device: torch.device) -> torch.dtype | None:
    """What the KV pool stores for `kv_cache_dtype` `name` on `device` (None: the model's
    dtype); fp8 needs a CUDA device that converts to it (compute capability 8.9+)."""
    if name == "fp8_e4m3":
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype 'fp8_e4m3' needs a CUDA device, not {device} (use 'int8')")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("kv_cache_dtype 'fp8_e4m3' needs a GPU of compute capability 8.9 or newer (use 'int8')")
    return KV_CACHE_DTYPES[name]


def draft_footprint(path: str, shape: KVShape, context_len: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of the draft checkpoint at `path` run beside a
    model of KV `shape`: its weights in the model's dtype, its pool in the same storage."""
    draft = ModelConfig.from_pretrained(path, context_length=context_len, supported=supported_architectures())
    draft_shape = replace(shape, num_layers=draft.num_layers, num_kv_heads=draft.num_kv_heads,
                          head_dim=draft.head_dim)
    weights = parameter_count(path) * torch.empty((), dtype=shape.dtype).element_size()
    return weights, draft_shape.bytes_per_token


def _num_slots(config: RunnerConfig, shape: KVShape, device: torch.device, draft_model_path: str | None,
               context_len: int) -> int:
    """Usable KV slots, a positive multiple of the page size (see `RunnerConfig`); on CUDA
    the footprint of a draft model at `draft_model_path` comes out of the same budget."""
    page = config.page_size
    if config.max_total_tokens is not None:
        slots = config.max_total_tokens - config.max_total_tokens % page
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.mem_fraction_static)
        if draft_model_path is not None:
            # a draft that cannot be read keeps the budget whole: its own checks then refuse it, naming the flag
            with contextlib.suppress(OSError, ValueError, KeyError):
                weights, per_token = draft_footprint(draft_model_path, shape, context_len)
                budget = max(0, budget - weights) * shape.bytes_per_token // (shape.bytes_per_token + per_token)
        slots = slots_for_budget(budget, shape, page)
    else:
        cap = CPU_DEFAULT_TOKENS * replace(shape, storage=None).bytes_per_token // shape.bytes_per_token
        cap -= cap % page
        slots = min(cap, slots_for_budget(CPU_KV_BUDGET_BYTES, shape, page))
    if slots <= 0:
        raise ValueError(
            f"no room for a KV cache: {shape.bytes_per_token} bytes per token, page size {page}"
        )
    return slots
