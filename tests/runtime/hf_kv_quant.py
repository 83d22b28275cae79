"""transformers with sprig's quantized KV cache emulated: an attention implementation that
rounds every token's K and V, per KV head, through `sprig.kernels.kv_quant`'s rule before
SDPA, so its logits are what sprig computes over an int8 cache (up to float rounding, which
can tip a value across a rounding boundary: one step of that row's scale)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sprig.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from sprig.radix.kv_cache import KV_CACHE_DTYPES


def _attention(storage: torch.dtype):
    def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        # key, value: [B, Hkv, L, D]; a row of D values is one token's head
        key = dequantize_kv_ref(*quantize_kv_ref(key, storage), key.dtype)
        value = dequantize_kv_ref(*quantize_kv_ref(value, storage), value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attend


def hf_model(path: Path, kv_cache_dtype: str = "auto") -> torch.nn.Module:
    """transformers' float32 model of the checkpoint at `path`, attending over K/V rounded as
    sprig's `kv_cache_dtype` cache stores them ("auto": plain)."""
    storage = KV_CACHE_DTYPES[kv_cache_dtype]
    if storage is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    name = f"sprig_kv_{kv_cache_dtype}"
    AttentionInterface.register(name, _attention(storage))
    AttentionMaskInterface.register(name, sdpa_mask)  # without a mask of its own, SDPA sees no sliding window
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()
