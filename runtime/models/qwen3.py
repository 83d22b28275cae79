"""Qwen3: Llama wiring with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True
        )
