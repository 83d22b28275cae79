"""Gemma 3 (the text model, `Gemma3ForCausalLM`, and with its image encoder,
`Gemma3ForConditionalGeneration`) and Gemma 2: Llama's attention and
projections with Gemma's differences. Every RMSNorm scales by 1 + weight (`unit_offset`), four per layer:
before and after attention, before and after the MLP; the MLP is GeGLU (tanh GELU); the
embedding is scaled by sqrt(hidden_size) rounded to the model's dtype; q and k heads are
normed; the softmax scale is query_pre_attn_scalar ** -0.5; the sliding-window layers have
their own, unscaled RoPE base; logits may be soft-capped."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.layers.embedding import VocabEmbedding
from sprig.runtime.layers.norm import RMSNorm
from sprig.runtime.layers.rotary import LayerRotaries, RotaryEmbedding
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.gemma3_vision import Gemma3ImageEncoder, encoder_param_name
from sprig.runtime.models.llama import LlamaForCausalLM, feed_forward, self_attention


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: each sub-block's output is normed before it joins the residual
    stream, which travels beside the hidden states so the next pre-norm fuses the add."""

    def __init__(self, config: ModelConfig, layer_id: int, options: AttentionOptions) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.self_attn = self_attention(config, layer_id, options)
        self.post_attention_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.mlp = feed_forward(config, layer_id)
        self.post_feedforward_layernorm = RMSNorm(H, eps, unit_offset=True)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None,  # [T, H]; None in the first layer
        batch: ForwardBatch,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden, residual: [T, H] each
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch, backend, rotary))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    """The embedding, the layers (each given the RoPE of its kind) and the final norm."""

    def __init__(self, config: ModelConfig, options: AttentionOptions) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotaries = LayerRotaries(config)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, options) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self._normalizers: dict[torch.dtype, float] = {}

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:  # [T, H]
        hidden = self.embed_tokens(batch.input_ids)  # [T, H]
        hidden = hidden * self._normalizer(hidden.dtype)
        if batch.image_rows is not None:  # image embeddings replace their tokens' (unscaled)
            hidden = hidden.index_copy(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, batch, backend, self.rotaries.of(i))
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _normalizer(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as `dtype` holds it: transformers multiplies by the rounded value."""
        if dtype not in self._normalizers:
            self._normalizers[dtype] = float(torch.tensor(self.hidden_size**0.5, dtype=dtype))
        return self._normalizers[dtype]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Also the text model of a `Gemma3ForConditionalGeneration` checkpoint (gemma-3-4b and
    up), whose language model's tensors it loads (`checkpoint_prefixes`, either
    transformers' naming) and whose vision tower and projector it skips."""

    checkpoint_prefixes: ClassVar[dict[str, str]] = {
        "language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head.",
    }
    unused_prefixes: ClassVar[tuple[str, ...]] = (
        "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
    )

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True, gemma_norm=True
        )

    @classmethod
    def decoder(cls, config: ModelConfig) -> nn.Module:
        return Gemma3Model(config, cls.attention_options(config))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] f32
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma 3 vision-language checkpoint (gemma-3-4b and up): the text model, and the
    image encoder (`Gemma3ImageEncoder`) whose embeddings replace the image tokens' own
    (`ForwardBatch.image_rows`). The encoder's tensors load under `image_encoder.`
    (`encoder_param_name` reads every naming of them)."""

    encoder_prefix: ClassVar[str] = "image_encoder."
    encoder_param = staticmethod(encoder_param_name)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.image is None:
            raise ValueError(f"{type(self).__name__} needs its config's image spec")
        self.image_encoder = Gemma3ImageEncoder.from_hf(
            {"vision_config": config.image.vision, "mm_tokens_per_image": config.image.tokens_per_image},
            config.hidden_size)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, tokens_per_image, H]
        """Each image's token embeddings, in the model's dtype, as its text model takes them."""
        return self.image_encoder(pixels)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's network without q/k norms, with attention scores soft-capped
    (`ModelConfig.attention_softcap`) and one RoPE for every layer."""

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)
