"""Mixture-of-experts models: the dense families' wiring with `SparseMoE` blocks in the
layers `ModelConfig.moe` makes sparse (`sprig.runtime.models.llama.feed_forward`)."""

from __future__ import annotations

from typing import ClassVar

from sprig.runtime.layers.attention import AttentionOptions
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models.llama import LlamaForCausalLM
from sprig.runtime.models.qwen2 import Qwen2ForCausalLM
from sprig.runtime.models.qwen3 import Qwen3ForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention; checkpoints name the sparse block `block_sparse_moe`
    (transformers' module, and sprig's, is `mlp`), each expert's projections `w1` (gate),
    `w3` (up) and `w2` (down)."""

    expert_projections: ClassVar[dict[str, tuple[str, str]]] = {
        "w1": ("gate_up_proj", "gate"),
        "w3": ("gate_up_proj", "up"),
        "w2": ("down_proj", "down"),
    }
    renamed_modules: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp"}

    @staticmethod
    def attention_options(config: ModelConfig) -> AttentionOptions:
        return AttentionOptions()


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention; experts plus a gated shared expert."""


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention; experts only."""
