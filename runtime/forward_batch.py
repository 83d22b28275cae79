"""What one forward pass needs to know about its batch: the metadata every attention backend reads."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sprig.radix.kv_cache import KVCache


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens per request >= 1, attending to a cached prefix and causally
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """Flattened batch of new tokens; `T` new tokens over `B` requests.

    Invariants:
    - `qo_indptr[b+1] - qo_indptr[b]` is the number of new tokens of request b.
    - `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` are the slots of request b's *full*
      context, cached prefix and new tokens alike, in position order; the new tokens
      are the last `q_len` of them.
    - `out_cache_loc[qo_indptr[b]:qo_indptr[b+1]]` equals those last `q_len` slots:
      a layer stores its new K/V there before attending.
    - New token i (0-based) of request b sits at context position `kv_len - q_len + i`
      and attends to context positions `0 ..= kv_len - q_len + i` (in a layer with a
      sliding window, only to the last `window` of them: `AttentionBackend.forward`).
    - `attend_until` (EXTEND only; None in DECODE and for plain causal attention) holds
      one entry per new token: the new token t at context position p attends to the
      positions `j < attend_until[t]` instead (in a layer with a sliding window W, only
      to those with `j >= max(0, p - W + 1)` too), with `p + 1 <= attend_until[t] <=
      kv_len` of its request. An image block's tokens (Gemma 3) hold the block's end:
      they see one another bidirectionally, every other token causally.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 (slot indices)
    out_cache_loc: torch.Tensor  # [T] int64
    kv_cache: KVCache
    max_q_len: int
    max_kv_len: int
    lora_slots: torch.Tensor | None = None  # [T] int64: each new token's LoRA slot (-1 none); None: no adapter
    attend_until: torch.Tensor | None = None  # [T] int64 on the batch's device, EXTEND only: see above
    # a model with an image encoder: rows of the new tokens whose embeddings are image
    # embeddings instead of their token's ([M] int64), and those embeddings ([M, H])
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
