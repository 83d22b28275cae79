"""The plain attention backend: each request gathers its own context from the paged pool
(a quantized pool's K/V dequantized as they are gathered) and attends over it
(`decode_attention_ref`, `extend_attention_ref`). Nothing is shared between requests or
kept between steps; it is what every other backend must equal, and what shadow mode
(`shadow.py`) checks them against."""

from __future__ import annotations

import torch

from sprig.kernels.decode_attention import decode_attention_ref
from sprig.kernels.extend_attention import extend_attention_ref
from sprig.kernels.store_kv import store_kv_ref
from sprig.radix.kv_cache import KVCache
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig


class ReferenceAttentionBackend:
    """Stateless: `begin_step` does nothing, and each `forward` reads only its arguments
    and the pool."""

    supports_cuda_graph = False

    def __init__(self, model_config: ModelConfig, kv_cache: KVCache) -> None:
        """The registry's constructor convention; nothing is kept."""

    def begin_step(self, batch: ForwardBatch) -> None:
        """Nothing to plan."""

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
        kv = batch.kv_cache.layers[layer]
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
        store_kv_ref(kv.k, kv.v, batch.out_cache_loc, k, v, **scales)
        if batch.mode is ForwardMode.DECODE:
            return decode_attention_ref(
                q, kv.k, kv.v, batch.kv_indptr, batch.kv_indices,
                sm_scale=sm_scale, window=window, softcap=softcap, sinks=sinks, **scales,
            )
        return extend_attention_ref(
            q, kv.k, kv.v, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
            sm_scale=sm_scale, window=window, softcap=softcap, attend_until=batch.attend_until, sinks=sinks,
            **scales,
        )
