"""The torch attention backend (the CPU path): plain torch ops, with the shared-prefix
plan of each step and K/V kept across decode steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sprig.kernels.extend_attention import extend_attention_ref
from sprig.kernels.paged import check_sinks, check_window
from sprig.kernels.softcap import check_softcap
from sprig.kernels.store_kv import store_kv_ref
from sprig.radix.kv_cache import KVCache, LayerKV
from sprig.runtime.attention.cpu import cascade
from sprig.runtime.attention.cpu.buckets import PaddedRows, gather_bucket_kv
from sprig.runtime.attention.cpu.kept_kv import KeptKV
from sprig.runtime.attention.cpu.plan import (
    DecodePlan,
    SharingPlan,
    trim_to_window,
    widened_requests,
    window_bites,
)
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig

# Most bytes of gathered K/V kept across decode steps (float32 copies), for shared
# prefixes and for the remainders each.
KEPT_KV_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class _Step:
    """What the layers of one step share: its plan, made by `begin_step`, and the plans
    of its windowed layers, one per window, made by the first layer with that window.

    `windowed[w]` is the plan layers with sliding window w run by: `plan` itself where w
    hides nothing (no context is longer), else for decode a `DecodePlan` over each
    context's last w slots, and for extend None (the per-request reference).
    """

    batch: ForwardBatch
    plan: DecodePlan | SharingPlan
    windowed: dict[int, DecodePlan | SharingPlan | None] = field(default_factory=dict)


class TorchAttentionBackend:
    """Stores new K/V with `store_kv_ref`, then attends by the step's plan, made by
    `begin_step`: a prefix that several requests share is read once for all of them
    (`cascade`); during a run of decode steps the gathered K/V are kept (`KeptKV`), each
    entry checked against the step's slots before it is used. A layer with a sliding
    window decodes the same way over the contexts cut to the window (a cut context
    shares a prefix only with cuts that start at the same slot; its kept K/V are keyed
    with the window, and a cut that slid by a slot fails the check and is gathered
    again, so buckets with a context as long as the window are not kept at all); an
    extend that the window cuts runs the per-request reference with it, its queries in
    blocks each over the slots its window reaches (`banded_attention_ref`). An extend's
    request with image blocks (`batch.attend_until` lets a token see past itself) runs the
    per-request reference with its attend_until, in no group (`SharingPlan.alone`); the
    other requests of the step keep the plan's paths. A soft-capped
    layer (`softcap`) runs the same plans with its scores capped in every part (shared
    prefix, remainders, per-request reference), written out where the fused CPU kernel
    would run (`attention_lse`); the kept K/V do not depend on the cap. A layer with
    attention sinks (`sinks`) runs the same plans too: each row's sink joins once, after
    its shared prefix and remainder are merged by log-sum-exp (the per-request reference
    adds its own); the kept K/V do not depend on the sinks either.

    Invariant: `begin_step(batch)` precedes the layers' `forward(..., batch)` calls of a
    step, and every step of the pool goes through this backend (a step it did not see
    could rewrite slots whose gathered K/V it keeps).
    """

    supports_cuda_graph = False

    def __init__(self, model_config: ModelConfig, kv_cache: KVCache) -> None:
        """The registry's constructor convention; the pool comes with each batch."""
        self.q_heads, self.kv_heads = model_config.num_heads, model_config.num_kv_heads
        self._step: _Step | None = None
        self.kept_kv = KeptKV(KEPT_KV_BUDGET_BYTES)

    def begin_step(self, batch: ForwardBatch) -> None:
        """Plan the step (which requests share a prefix, which have image blocks); forget
        the kept K/V unless this is a decode step."""
        if batch.mode is ForwardMode.DECODE:
            plan = DecodePlan.build(batch.kv_indptr, batch.kv_indices, self.q_heads, self.kv_heads)
        else:
            self.kept_kv.clear()
            until = batch.attend_until
            alone = None if until is None else widened_requests(batch.qo_indptr, batch.kv_indptr, until)
            plan = SharingPlan.build(batch.kv_indptr, batch.kv_indices, alone=alone)
        self._step = _Step(batch, plan)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        batch: ForwardBatch,
        *,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq] float32
    ) -> torch.Tensor:  # [T, Hq, D]
        step = self._step
        if step is None or step.batch is not batch:
            raise RuntimeError("TorchAttentionBackend.forward: call begin_step(batch) first")
        check_softcap(softcap)
        check_sinks(sinks, q)
        plan = step.plan if window is None else self._windowed_plan(step, window)
        kv = batch.kv_cache.layers[layer]
        store_kv_ref(kv.k, kv.v, batch.out_cache_loc, k, v, k_scale=kv.k_scale, v_scale=kv.v_scale)
        if isinstance(plan, DecodePlan):
            return self._decode(q, plan, layer, kv, window, sm_scale, softcap, sinks)
        if plan is None:
            return extend_attention_ref(
                q, kv.k, kv.v, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                sm_scale=sm_scale, k_scale=kv.k_scale, v_scale=kv.v_scale, window=window, softcap=softcap,
                attend_until=batch.attend_until, sinks=sinks, banded=True,
            )
        return cascade.extend_attention(
            q, kv, batch.qo_indptr, plan, sm_scale=sm_scale, softcap=softcap, attend_until=batch.attend_until,
            sinks=sinks,
        )

    def _decode(
        self, q: torch.Tensor, plan: DecodePlan, layer: int, kv: LayerKV, window: int | None, sm_scale: float,
        softcap: float | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, Hq, D]
        """Cascade decode by `plan`, K/V from the kept stores; a windowed layer's entries
        carry its window in their keys. A remainder bucket holding a context as long as
        the window is gathered and not kept: that context slides a slot a step, so its
        kept K/V could never be extended."""
        kept = self.kept_kv
        tag = () if window is None else (window,)

        def rest_kv(i: int, bucket: PaddedRows) -> tuple[torch.Tensor, torch.Tensor]:
            if window is not None and bucket.slots.shape[1] >= window:  # its longest row is at the window
                return gather_bucket_kv(kv, bucket)
            return kept.tails.get((layer, i, *tag), bucket, kv)

        return cascade.decode_attention(
            q, plan, rest_kv, lambda i, bucket: kept.prefixes.get((layer, i, *tag), bucket, kv),
            sm_scale=sm_scale, softcap=softcap, sinks=sinks,
        )

    def _windowed_plan(self, step: _Step, window: int) -> DecodePlan | SharingPlan | None:
        """`step.windowed[window]`, made on first use."""
        if window not in step.windowed:
            check_window(window)
            batch = step.batch
            if not window_bites(batch.kv_indptr, window):
                plan = step.plan
            elif batch.mode is ForwardMode.DECODE:
                cut_indptr, cut_indices = trim_to_window(batch.kv_indptr, batch.kv_indices, window)
                plan = DecodePlan.build(cut_indptr, cut_indices, self.q_heads, self.kv_heads)
            else:
                plan = None
            step.windowed[window] = plan
        return step.windowed[window]
