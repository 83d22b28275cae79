"""The Triton attention backend (the CUDA path): `store_kv`, `extend_attention` and
`decode_attention` launchers from `sprig.kernels`, called directly so that the backend is
Triton on any device (on the CPU it runs in the interpreter, `TRITON_INTERPRET=1`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.kernels.decode_attention import decode_attention_triton, default_num_kv_splits, num_sms
from sprig.kernels.extend_attention import extend_attention_triton
from sprig.kernels.store_kv import store_kv_triton
from sprig.radix.kv_cache import KVCache
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig


@dataclass(frozen=True)
class _StepPlan:
    """What every layer of one step shares, computed once by `begin_step`."""

    batch: ForwardBatch  # the batch this plan was made for (checked by identity)
    out: torch.Tensor  # [T, Hq, D] attention output, reused by every layer
    num_kv_splits: int  # decode split-KV factor (a function of B and Hkv only)


class TritonAttentionBackend:
    """Stores new K/V with `store_kv_triton`, then `extend_attention_triton` or
    `decode_attention_triton` by the batch's mode (a quantized pool: quantized on store,
    dequantized on load, by the kernels' `KV_QUANT` variants; a sliding window: the
    kernels' `WINDOWED` variants, the window a kernel argument, so decode steps with
    windowed layers are captured in CUDA graphs as any others; a soft-capped layer: the
    `SOFTCAP` variants, the cap a kernel argument too; image blocks, the extend kernel's
    `ATTEND_UNTIL` variant, reading the batch's `attend_until` on the device; attention
    sinks, the `SINKS` variants, reading the layer's `sinks` on the device, so that a
    decode step with them is captured as any other).

    Invariants: `begin_step(batch)` precedes the layers' `forward(..., batch)` calls of a
    step (forward raises otherwise). The tensor `forward` returns is the step's shared
    output buffer: the next layer's call overwrites it, so consume it first.
    """

    supports_cuda_graph = True

    def __init__(self, model_config: ModelConfig, kv_cache: KVCache) -> None:
        self.num_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.num_sms = num_sms(kv_cache.device)
        self._plan: _StepPlan | None = None

    def begin_step(self, batch: ForwardBatch) -> None:
        """Plan the step: allocate the output buffer and pick the decode split factor."""
        cache = batch.kv_cache
        out = torch.empty(
            (batch.num_tokens, self.num_heads, self.head_dim),
            dtype=cache.shape.dtype, device=cache.device,
        )  # [T, Hq, D]
        splits = (
            default_num_kv_splits(batch.batch_size, self.num_kv_heads, self.num_sms)
            if batch.mode is ForwardMode.DECODE
            else 1
        )
        self._plan = _StepPlan(batch, out, splits)

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
        plan = self._plan
        if plan is None or plan.batch is not batch:
            raise RuntimeError("TritonAttentionBackend.forward: call begin_step(batch) first")
        if q.dtype != plan.out.dtype:
            raise ValueError(f"q is {q.dtype} but the KV cache reads as {plan.out.dtype}")
        kv = batch.kv_cache.layers[layer]
        scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
        store_kv_triton(kv.k, kv.v, batch.out_cache_loc, k, v, **scales)
        if batch.mode is ForwardMode.DECODE:
            return decode_attention_triton(
                q, kv.k, kv.v, batch.kv_indptr, batch.kv_indices,
                sm_scale=sm_scale, num_kv_splits=plan.num_kv_splits, out=plan.out, window=window, softcap=softcap,
                sinks=sinks, **scales,
            )
        return extend_attention_triton(
            q, kv.k, kv.v, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
            sm_scale=sm_scale, max_q_len=batch.max_q_len, out=plan.out, window=window, softcap=softcap,
            attend_until=batch.attend_until, sinks=sinks, **scales,
        )
