"""The torch attention backend (the CPU path): plain torch ops, with the shared-prefix
plan of each step and K/V kept across decode steps."""

from __future__ import annotations

import torch

from sprig.kernels.store_kv import store_kv_ref
from sprig.radix.kv_cache import KVCache
from sprig.runtime.attention.cpu import cascade
from sprig.runtime.attention.cpu.kept_kv import KeptKV
from sprig.runtime.attention.cpu.plan import DecodePlan, SharingPlan
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig

# Most bytes of gathered K/V kept across decode steps (float32 copies), for shared
# prefixes and for the remainders each.
KEPT_KV_BUDGET_BYTES = 256 << 20


class TorchAttentionBackend:
    """Stores new K/V with `store_kv_ref`, then attends by the step's plan, made by
    `begin_step`: a prefix that several requests share is read once for all of them
    (`cascade`); during a run of decode steps the gathered K/V are kept (`KeptKV`), each
    entry checked against the step's slots before it is used.

    Invariant: `begin_step(batch)` precedes the layers' `forward(..., batch)` calls of a
    step, and every step of the pool goes through this backend (a step it did not see
    could rewrite slots whose gathered K/V it keeps).
    """

    supports_cuda_graph = False

    def __init__(self, model_config: ModelConfig, kv_cache: KVCache) -> None:
        """The registry's constructor convention; the pool comes with each batch."""
        self.q_heads, self.kv_heads = model_config.num_heads, model_config.num_kv_heads
        self._plan: tuple[ForwardBatch, DecodePlan | SharingPlan] | None = None
        self.kept_kv = KeptKV(KEPT_KV_BUDGET_BYTES)

    def begin_step(self, batch: ForwardBatch) -> None:
        """Plan the step (which requests share a prefix); forget the kept K/V unless this
        is a decode step."""
        if batch.mode is ForwardMode.DECODE:
            plan = DecodePlan.build(batch.kv_indptr, batch.kv_indices, self.q_heads, self.kv_heads)
        else:
            self.kept_kv.clear()
            plan = SharingPlan.build(batch.kv_indptr, batch.kv_indices)
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
        kv = batch.kv_cache.layers[layer]
        store_kv_ref(kv.k, kv.v, batch.out_cache_loc, k, v, k_scale=kv.k_scale, v_scale=kv.v_scale)
        if isinstance(plan, DecodePlan):
            kept = self.kept_kv
            return cascade.decode_attention(
                q, plan,
                lambda i, bucket: kept.tails.get((layer, i), bucket, kv),
                lambda i, bucket: kept.prefixes.get((layer, i), bucket, kv),
                sm_scale=sm_scale,
            )
        return cascade.extend_attention(q, kv, batch.qo_indptr, plan, sm_scale=sm_scale)
