"""OLMo 2 and OLMo 3: Llama's projections and MLP with the norms after each sub-block, not
before it (the residual stream enters attention and the MLP as it is), q and k each normed
over their whole projection, and every RMSNorm scaled in float32 and rounded once. OLMo 3
adds sliding-window layers (three of every four) whose RoPE is never scaled."""

from __future__ import annotations

import torch
from torch import nn

from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.layers.embedding import VocabEmbedding
from sprig.runtime.layers.norm import RMSNorm
from sprig.runtime.layers.rotary import LayerRotaries, RotaryEmbedding
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import LlamaForCausalLM, feed_forward, self_attention


class OlmoDecoderLayer(nn.Module):
    """Post-norm block: x + norm(attn(x)), then that + norm(mlp(that)). The last add is
    left to the next layer (its output is (mlp's normed output, the stream before it))."""

    def __init__(self, config: ModelConfig, layer_id: int, options: AttentionOptions) -> None:
        super().__init__()
        self.self_attn = self_attention(config, layer_id, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=True)
        self.mlp = feed_forward(config, layer_id)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=True)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None in the first layer
        batch: ForwardBatch,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: [T, H] each
        stream = hidden if residual is None else residual + hidden
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, batch, backend, rotary))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class OlmoModel(nn.Module):
    def __init__(self, config: ModelConfig, options: AttentionOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotaries = LayerRotaries(config)
        self.layers = nn.ModuleList(OlmoDecoderLayer(config, i, options) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=True)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:  # [T, H]
        hidden, residual = self.embed_tokens(batch.input_ids), None  # [T, H]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, batch, backend, self.rotaries.of(i))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Under tensor parallelism each rank norms its heads of q and k by the whole
    projection's mean square, summed over the ranks (`distributed.norm`)."""

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                                olmo_norm=True)

    @classmethod
    def decoder(cls, config: ModelConfig) -> nn.Module:
        return OlmoModel(config, cls.attention_options(config))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2's network with sliding-window layers (`ModelConfig.sliding_layers`)."""
