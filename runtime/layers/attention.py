"""Self-attention of the Llama family (and Gemma 3): fused qkv projection, optional per-head
q/k norm, RoPE, the attention backend (paged KV store + attention, within a sliding window
in a windowed layer), output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.layers.linear import MergedLinear
from sprig.runtime.layers.norm import RMSNorm
from sprig.runtime.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionOptions:
    """How a family's attention differs: biases, and RMSNorm of each q/k head before RoPE
    (Gemma's `unit_offset` norm with `gemma_norm`; with `olmo_norm`, OLMo's: one norm over
    all of q's heads and one over all of k's, scaled in float32 and rounded once); with
    `sinks`, a learned logit per query head that joins each softmax's denominator
    (gpt-oss's `sinks` parameter; see `AttentionBackend.forward`)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False
    olmo_norm: bool = False
    sinks: bool = False


class SelfAttention(nn.Module):
    """MHA, GQA or MQA (`num_heads % num_kv_heads == 0`) for decoder layer `layer_id`: a
    token attends to its whole context, or with `window` W to its last W positions
    (itself included). Softmax scale `sm_scale`, head_dim ** -0.5 unless given; with
    `softcap` c, each scaled score s becomes c * tanh(s / c) (Gemma 2)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_id: int,
        options: AttentionOptions,
        norm_eps: float,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.window = window
        self.softcap = softcap
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=options.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, hidden_size, bias=options.o_bias)
        self.q_norm = self.k_norm = None
        self.norm_whole = options.olmo_norm
        if options.qk_norm:
            q_span, k_span = (q_size, kv_size) if options.olmo_norm else (head_dim, head_dim)
            style = {"unit_offset": options.gemma_norm, "round_once": options.olmo_norm}
            self.q_norm = RMSNorm(q_span, norm_eps, **style)
            self.k_norm = RMSNorm(k_span, norm_eps, **style)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if options.sinks else None  # [Hq]

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        batch: ForwardBatch,
        backend: AttentionBackend,
        rotary: RotaryEmbedding | None,  # None: no position embedding (a NoPE layer)
    ) -> torch.Tensor:  # [T, H]
        T, Hq, Hkv, D = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        q_size, kv_size = Hq * D, Hkv * D
        v = qkv[:, q_size + kv_size :].view(T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]  # [T, Hq D], [T, Hkv D]
            if not self.norm_whole:
                q, k = q.view(T, Hq, D), k.view(T, Hkv, D)
            q, k = self.q_norm(q).view(T, Hq, D), self.k_norm(k).view(T, Hkv, D)
            if rotary is not None:
                q, k = rotary(batch.positions, q), rotary(batch.positions, k)
        else:  # q's and k's heads side by side in the projection: one rotation for both
            qk = qkv[:, : q_size + kv_size].view(T, Hq + Hkv, D)
            if rotary is not None:
                qk = rotary(batch.positions, qk)
            q, k = qk[:, :Hq], qk[:, Hq:]  # [T, Hq, D], [T, Hkv, D]
        sinks = None if self.sinks is None else self.sinks.float()  # [Hq]
        o = backend.forward(q, k, v, self.layer_id, batch, sm_scale=self.sm_scale, window=self.window,
                            softcap=self.softcap, sinks=sinks)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, q_size))
