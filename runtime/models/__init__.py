"""The model registry: `architectures[0]` of a checkpoint's config.json -> model class.

A model class is built as `cls(config: ModelConfig)` and provides
`forward(batch, backend) -> hidden [T, H]`, `compute_logits(hidden [R, H]) -> [R, V]`
float32, and `packed_modules` (how checkpoint tensors map onto fused projections).
"""

from __future__ import annotations

from torch import nn

from sprig.runtime.models.gemma3 import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from sprig.runtime.models.gpt_oss import GptOssForCausalLM
from sprig.runtime.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    SmolLM3ForCausalLM,
)
from sprig.runtime.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from sprig.runtime.models.olmo import Olmo2ForCausalLM, Olmo3ForCausalLM
from sprig.runtime.models.phi3 import Phi3ForCausalLM
from sprig.runtime.models.qwen2 import Qwen2ForCausalLM
from sprig.runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_REGISTRY)


def model_class(architecture: str) -> type[nn.Module]:
    """The class for `architecture`; ValueError listing the supported ones otherwise."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]
