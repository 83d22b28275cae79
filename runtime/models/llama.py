"""Llama (and Mistral, whose dense-attention form is the same network): the wiring
of the shared layers that the Qwen families reuse with other attention options."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.layers.attention import AttentionOptions, SelfAttention
from sprig.runtime.layers.embedding import LMHead, VocabEmbedding
from sprig.runtime.layers.mlp import GatedMLP
from sprig.runtime.layers.moe import GptOssMoE, SparseMoE
from sprig.runtime.layers.norm import RMSNorm
from sprig.runtime.layers.rotary import RotaryEmbedding
from sprig.runtime.model_config import ModelConfig


def feed_forward(config: ModelConfig, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s feed-forward block: sparse (`SparseMoE`, gpt-oss's `GptOssMoE`) in
    a mixture-of-experts model's sparse layers, else the dense SwiGLU MLP."""
    if config.moe is not None and layer_id not in config.moe.dense_layers:
        if config.moe.clamped_swiglu is not None:
            return GptOssMoE(config.hidden_size, config.moe)
        return SparseMoE(config.hidden_size, config.moe)
    return GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                    gelu=config.hidden_act == "gelu_pytorch_tanh")


def self_attention(config: ModelConfig, layer_id: int, options: AttentionOptions) -> SelfAttention:
    """Layer `layer_id`'s attention: the config's heads, softmax scale, score cap and (in a
    sliding layer) window."""
    return SelfAttention(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
        layer_id=layer_id, options=options, norm_eps=config.rms_norm_eps,
        sm_scale=config.attention_scale, window=config.attention_window(layer_id), softcap=config.attention_softcap,
    )


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden states so that each
    norm fuses the previous residual add. Each sub-block's output is scaled by the config's
    `residual_multiplier` (Granite's) before it joins the stream. With `round_once`, the
    norms scale in float32 and round once (gpt-oss's)."""

    def __init__(self, config: ModelConfig, layer_id: int, options: AttentionOptions, *,
                 round_once: bool = False) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=round_once)
        self.self_attn = self_attention(config, layer_id, options)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=round_once)
        self.mlp = feed_forward(config, layer_id)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None in the first layer
        batch: ForwardBatch,
        backend: AttentionBackend,
        rotary: RotaryEmbedding | None,  # None in a NoPE layer
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: [T, H] each
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._scaled(self.self_attn(hidden, batch, backend, rotary))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, options: AttentionOptions, *, round_once: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.context_len, base=config.rope_theta, scaling=config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, options, round_once=round_once) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, round_once=round_once)
        self.nope = frozenset(config.nope_layers)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:  # [T, H]
        hidden = self.embed_tokens(batch.input_ids)  # [T, H]
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        residual = None
        for i, layer in enumerate(self.layers):
            rotary = None if i in self.nope else self.rotary
            hidden, residual = layer(hidden, residual, batch, backend, rotary)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror the HF checkpoint's, except the fused projections listed
    in `packed_modules` (HF module name -> (sprig module name, shard)), each expert's
    projections, which `expert_projections` maps to their `FusedExperts` parameter and
    kind (`experts.{e}.{name}.weight` -> (parameter, kind), shard `"{e}.{kind}"`), and the
    modules `renamed_modules` names (checkpoint name -> sprig's, which is transformers'
    module name)."""

    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    expert_projections: ClassVar[dict[str, tuple[str, str]]] = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "down_proj": ("down_proj", "down"),
    }
    renamed_modules: ClassVar[dict[str, str]] = {}

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    @classmethod
    def decoder(cls, config: ModelConfig) -> nn.Module:
        """The network below the head: `forward(batch, backend) -> hidden [T, H]`, with the
        token embedding as `embed_tokens`."""
        return DecoderModel(config, cls.attention_options(config))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied=config.tie_word_embeddings)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Final-norm hidden states `[T, H]` of every new token; stores K/V of each layer."""
        return self.model(batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] f32
        logits = self.lm_head(hidden, self.model.embed_tokens)
        scale = self.config.logits_scaling
        return logits if scale == 1.0 else logits / scale


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite (3.x): Llama's network scaled by its config's multipliers (embedding,
    residual, attention) and logit divisor (`ModelConfig`)."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's network, with every fourth layer (`ModelConfig.nope_layers`)
    attending without RoPE."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's network without biases; a sliding window, when its config.json sets
    one, in every layer (`ModelConfig.attention_window`)."""

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions()
