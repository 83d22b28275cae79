"""The reference attention backend (and the CPU path): torch ops from `sprig.kernels`."""

from __future__ import annotations

import torch

from sprig.kernels.extend_attention import extend_attention_ref
from sprig.kernels.store_kv import store_kv_ref
from sprig.radix.kv_cache import KVCache
from sprig.runtime.attention.kept_kv import KeptKV
from sprig.runtime.attention.shared_prefix import (
    SharingPlan,
    plan_shared_prefixes,
    shared_prefix_decode_attention,
    shared_prefix_extend_attention,
)
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig

# Most bytes of gathered K/V kept across decode steps (float32 copies), for shared
# prefixes and for the remainders each.
KEPT_KV_BUDGET_BYTES = 256 << 20


class TorchAttentionBackend:
    """Stores new K/V with `store_kv_ref`, then `extend_attention_ref` or decode attention
    by the batch's mode. A prefix that several requests share is read once for all of them
    (`shared_prefix`), planned once per step by `begin_step`; during a run of decode steps
    the gathered K/V are kept (`KeptKV`): a group's while it holds the same slots, the
    remainders' while each step adds one token to every request.

    Invariant: `begin_step(batch)` precedes the layers' `forward(..., batch)` calls of a
    step, and every step of the pool goes through this backend (a step it did not see
    could rewrite slots whose gathered K/V it keeps).
    """

    def __init__(self, model_config: ModelConfig, kv_cache: KVCache) -> None:
        """The registry's constructor convention; the pool comes with each batch."""
        self._plan: tuple[ForwardBatch, SharingPlan] | None = None
        self.kept_kv = KeptKV(KEPT_KV_BUDGET_BYTES)

    def begin_step(self, batch: ForwardBatch) -> None:
        """Find the prefixes the batch's requests share (a decode step that continues
        the previous step's batch advances its plan); forget kept K/V unless this is a
        decode step."""
        plan = None
        if batch.mode is not ForwardMode.DECODE:
            self.kept_kv.clear()
        elif batch.prev_rows is not None and self._plan is not None:
            plan = self._plan[1].after_decode(
                batch.kv_indptr, batch.kv_indices, batch.out_cache_loc, batch.prev_rows
            )
        if plan is None:
            plan = plan_shared_prefixes(batch.kv_indptr, batch.kv_indices)
        self._plan = (batch, plan)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        batch: ForwardBatch,
        *,
        sm_scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        if self._plan is None or self._plan[0] is not batch:
            raise RuntimeError("TorchAttentionBackend.forward: call begin_step(batch) first")
        plan = self._plan[1]
        k_buffer, v_buffer = batch.kv_cache.k[layer], batch.kv_cache.v[layer]
        store_kv_ref(k_buffer, v_buffer, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return shared_prefix_decode_attention(
                q, k_buffer, v_buffer, plan, sm_scale=sm_scale, kept=self.kept_kv, layer=layer
            )
        if plan.groups:
            return shared_prefix_extend_attention(
                q, k_buffer, v_buffer, batch.qo_indptr, plan, sm_scale=sm_scale
            )
        return extend_attention_ref(
            q, k_buffer, v_buffer, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
            sm_scale=sm_scale,
        )
