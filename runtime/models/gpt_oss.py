"""OpenAI's gpt-oss: Llama's pre-norm wiring with biased attention projections, a learned
sink logit per query head, sliding-window attention in every other layer, YaRN RoPE, norms
scaled in float32 and rounded once, and a sparse block in every layer (`GptOssMoE`)."""

from __future__ import annotations

from torch import nn

from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import DecoderModel, LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    """Checkpoint names are transformers' (`self_attn.sinks`, `mlp.router`, `mlp.experts.*`);
    the experts load float or MXFP4 (`GptOssExperts`; split over tensor-parallel ranks by
    `sprig.runtime.distributed.shard`)."""

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, sinks=True)

    @classmethod
    def decoder(cls, config: ModelConfig) -> nn.Module:
        return DecoderModel(config, cls.attention_options(config), round_once=True)
