"""Qwen2: Llama wiring with a bias on the q, k and v projections (none on o)."""

from __future__ import annotations

from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
