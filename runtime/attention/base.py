"""The attention-backend interface: every backend reads the same `ForwardBatch` metadata."""

from __future__ import annotations

from typing import Protocol

import torch

from sprig.runtime.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """Stores a layer's new K/V in the paged pool, then attends over each request's context.

    Per step: `begin_step(batch)` once, then `forward(..., layer, batch)` for each layer
    with that same batch. `supports_cuda_graph`: a decode step through it can be captured
    and replayed (fixed-shape buffers, no host synchronisation).
    """

    supports_cuda_graph: bool

    def begin_step(self, batch: ForwardBatch) -> None:
        """Prepare what every layer of this step shares (split factors, buffers)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer: int,
        batch: ForwardBatch,
        *,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Write k, v at `batch.out_cache_loc` of `layer`, then return attention output.

        Extend: new token i of request b attends causally to its context (see
        `ForwardBatch`); where `batch.attend_until` is given, the new token t (flattened
        index) at context position p attends to the positions `j < batch.attend_until[t]`
        instead, with `p + 1 <= batch.attend_until[t] <= kv_len` of its request (an image
        block's tokens see the whole block, Gemma 3; None: causal for every token).
        Decode: each request's single token attends to its whole context.
        `window` W (an int >= 1; None: full attention) is the layer's sliding window: the
        token at context position p then attends only to positions `max(0, p - W + 1) ..= p`
        (with attend_until, to those from `max(0, p - W + 1)` below it; a decode token to
        its context's last min(len, W) slots). A layer's window is the same at every step;
        K/V outside it stay in the pool, written as usual.
        `softcap` (a finite float > 0, else `ValueError`; None: no capping) is the layer's
        attention-logit soft cap (Gemma 2): each scaled score s = q.k * sm_scale becomes
        `softcap * tanh(s / softcap)` before the mask and the softmax. Like the window, it
        is the same for a layer at every step and changes nothing that is stored.
        `sinks` (None: no sinks) are the layer's attention sinks (gpt-oss): a contiguous
        float32 tensor `[num_q_heads]` on q's device (else `ValueError`), sinks[h] a logit
        that joins the softmax of every row of query head h as one more column, neither
        scaled by sm_scale nor capped, whose value is zero: with L the log-sum-exp of the
        row's scaled, capped, masked scores, the output is the plain one times
        `exp(L) / (exp(L) + exp(sinks[h]))`, once per row however the backend splits the
        context. Read on the device (a model parameter at a fixed address, so a captured
        decode step stays valid); like the cap, it changes nothing that is stored.
        """
        ...
