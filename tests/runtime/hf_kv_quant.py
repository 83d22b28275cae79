"""transformers with sprig's quantized KV cache emulated: an attention implementation that
rounds every token's K and V, per KV head, through `sprig.kernels.kv_quant`'s rule before
SDPA (eager attention for a model whose scores are soft-capped, gpt-oss's own for its sinks;
a vision tower's attention, which no cache holds, stays plain SDPA), so its logits are what sprig computes over an int8 cache (up to float rounding, which
can tip a value across a rounding boundary: one step of that row's scale)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import (
    eager_attention_forward as sink_attention_forward,
)

from sprig.kernels.kv_quant import dequantize_kv_ref, quantize_kv_ref
from sprig.radix.kv_cache import KV_CACHE_DTYPES


def _attention(storage: torch.dtype, capped: bool, sinks: bool):
    def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        # key, value: [B, Hkv, L, D]; a row of D values is one token's head
        key = dequantize_kv_ref(*quantize_kv_ref(key, storage), key.dtype)
        value = dequantize_kv_ref(*quantize_kv_ref(value, storage), value.dtype)
        forward = sdpa_attention_forward  # SDPA cannot cap scores nor add sinks
        if capped or sinks:
            forward = sink_attention_forward if sinks else eager_attention_forward
        return forward(module, query, key, value, attention_mask, **kwargs)

    return attend


def hf_model(path: Path, kv_cache_dtype: str = "auto") -> torch.nn.Module:
    """transformers' float32 model of the checkpoint at `path`, attending over K/V rounded as
    sprig's `kv_cache_dtype` cache stores them ("auto": plain)."""
    storage = KV_CACHE_DTYPES[kv_cache_dtype]
    if storage is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = json.loads((Path(path) / "config.json").read_text())
    capped = config.get("attn_logit_softcapping") is not None
    sinks = config.get("model_type") == "gpt_oss"
    name = f"sprig_kv_{kv_cache_dtype}{'_capped' if capped else ''}{'_sinks' if sinks else ''}"
    AttentionInterface.register(name, _attention(storage, capped, sinks))
    # without a mask function of its own, transformers passes no mask: no sliding window
    AttentionMaskInterface.register(name, eager_mask if capped or sinks else sdpa_mask)
    # only the language model's attention reads sprig's cache: a vision tower keeps SDPA
    implementation = {"text_config": name, "vision_config": "sdpa", "": name} if "vision_config" in config else name
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation).eval()
