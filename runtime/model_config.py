"""What sprig needs to know about a Hugging Face Llama-family checkpoint, read from its
config.json (and generation_config.json for the stop tokens)."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sprig.runtime.rope_config import (
    PER_LAYER_TYPE_ROPE,
    context_len,
    layer_type_rope,
    partial_rotary_factor,
    read_rope,
)

if TYPE_CHECKING:
    from sprig.runtime.quantization.formats import WeightFormat

log = logging.getLogger("sprig.model")

# config.json's `hidden_act` (Gemma: `hidden_activation`) values sprig computes: the gate's
# activation of a gated MLP (`sprig.kernels.activation`)
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward blocks of a mixture-of-experts checkpoint (Mixtral, Qwen2-MoE,
    Qwen3-MoE).

    Each token's router logits pick its `top_k` experts by softmax probability; their
    probabilities, renormalized to sum to 1 when `renormalize`, weight the experts'
    outputs. A shared expert (`shared_expert_intermediate_size` > 0, Qwen2-MoE) runs on
    every token, scaled by sigmoid of its own one-output gate. Layers in `dense_layers`
    keep a dense MLP of the model's `intermediate_size` instead.
    gpt-oss's experts (`clamped_swiglu` = (alpha, limit)): the router and every expert
    projection have a bias, each expert's gate and up rows are interleaved, and its
    activation is the clamped SwiGLU `sprig.kernels.moe.ClampedSwiGLU`; with
    `expert_format` "mxfp4" their weights stay in the checkpoint's MXFP4 (None: float).
    Invariants: 0 < top_k <= num_experts; expert_intermediate_size > 0; an MXFP4 expert's
    input sizes (hidden and intermediate) are multiples of 32.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    clamped_swiglu: tuple[float, float] | None = None
    expert_format: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.top_k}")
        if self.expert_intermediate_size <= 0:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.expert_intermediate_size}")
        if self.expert_format not in (None, "mxfp4") or (self.expert_format and self.clamped_swiglu is None):
            raise ValueError(f"experts in {self.expert_format!r} are not supported for this architecture")
        if self.expert_format and self.expert_intermediate_size % 32:
            raise ValueError(f"MXFP4 experts need an intermediate size that is a multiple of 32, "
                             f"got {self.expert_intermediate_size}")


@dataclass(frozen=True)
class ImageSpec:
    """How a vision-language checkpoint takes images (read from its config.json).

    A prompt holds each image as `begin_id`, then `tokens_per_image` copies of `token_id`
    (the positions its encoder's embeddings fill), then `end_id`. With `bidirectional`,
    the tokens of one image attend to each other in both directions during prefill
    (Gemma 3); every other token attends causally. `vision` is config.json's
    `vision_config` as transformers completes it (defaults filled in), read by the encoder.
    """

    token_id: int
    begin_id: int
    end_id: int
    tokens_per_image: int
    bidirectional: bool
    vision: dict[str, Any] = field(hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens_per_image < 1:
            raise ValueError(f"tokens_per_image must be positive, got {self.tokens_per_image}")
        if len({self.token_id, self.begin_id, self.end_id}) != 3:
            raise ValueError(f"image token ids must differ: {self.token_id}, {self.begin_id}, {self.end_id}")


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's architecture and geometry.

    Invariants: `num_heads % num_kv_heads == 0`; `rope_scaling` is None for plain RoPE,
    else a dict with `rope_type` in ("linear", "llama3", "yarn", "longrope") and that type's
    parameters (for llama3, yarn and longrope `original_max_position_embeddings` is always
    present, for yarn and longrope `factor` is a number, longrope's `short_factor` and
    `long_factor` each hold `rotary_dim / 2` numbers); RoPE rotates the first `rotary_dim`
    = head_dim x `partial_rotary_factor` dims of each head (even, > 0). A longrope model's
    factors are chosen once, by `context_len`: the short ones when it is at most
    `original_max_position_embeddings`, else the long ones (`longrope_factors`), so a
    token's rotation never depends on its batch. transformers chooses per forward call by
    the longest position in it: with the short factors sprig equals it on every sequence
    the context holds; with the long ones, on every forward whose sequence is longer than
    the original length (and not on shorter ones, which transformers rotates with the
    short factors, nor on a cached continuation that crosses it). `context_len` is the
    longest context sprig serves: the checkpoint's `max_position_embeddings`, or the
    `context_length` asked of `from_pretrained`, never past what the rope config covers;
    `eos_token_ids` is the union of config.json's and
    generation_config.json's, in that order; `quantization` is the format config.json's
    `quantization_config` names (None for a float checkpoint); `moe` describes the sparse
    blocks of a mixture-of-experts model (None for a dense one).

    Attention: the layers in `sliding_layers` attend within a sliding window, a token at
    position p to positions p - sliding_window + 1 .. p (`attention_window`); the others to
    their whole context. `sliding_window` is None exactly when `sliding_layers` is empty.
    `attention_scale` replaces the softmax scale head_dim ** -0.5 when set (Gemma's
    query_pre_attn_scalar ** -0.5); `sliding_rope_theta`, when set, is the RoPE base of the
    sliding layers (unscaled; Gemma 3's local base), the full layers keep `rope_theta` and
    `rope_scaling`. `hidden_act` is one of `GATED_ACTIVATIONS`; `final_logit_softcap` c,
    when set, maps logits x to c * tanh(x / c). The layers in `nope_layers` apply no RoPE
    (SmolLM3's NoPE layers). Granite's scalars: the embedding is multiplied by
    `embedding_multiplier`, each sub-block's output by `residual_multiplier` before it joins
    the residual stream, the logits divided by `logits_scaling` (all 1 elsewhere).
    `attention_softcap` c, when set, maps every scaled attention score s to c * tanh(s / c)
    (Gemma 2's `attn_logit_softcapping`). `image` describes how a vision-language
    checkpoint takes images (None: text only); `architecture` is then the multimodal one
    and every other field describes its text model.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_len: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's dtype name, e.g. "bfloat16"
    quantization: WeightFormat | None = field(default=None, hash=False)  # quantization_config's
    moe: MoEConfig | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attention_scale: float | None = None
    sliding_rope_theta: float | None = None
    final_logit_softcap: float | None = None
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_softcap: float | None = None
    image: ImageSpec | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "context_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {GATED_ACTIVATIONS}")
        if (self.sliding_window is None) != (not self.sliding_layers) or (self.sliding_window or 1) < 1:
            raise ValueError(f"sliding_window {self.sliding_window} with sliding layers {self.sliding_layers}")
        if self.moe is not None and self.hidden_act != "silu":
            raise ValueError(f"mixture-of-experts layers compute SwiGLU only, not {self.hidden_act!r}")
        for what, layers in (("sliding", self.sliding_layers), ("NoPE", self.nope_layers)):
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"{what} layers {layers} outside 0..{self.num_layers - 1}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                             f"rotates {self.rotary_dim} dims; it must rotate an even number > 0")
        if self.longrope_factors is not None:
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {key} has {len(self.rope_scaling[key])} entries; "
                                     f"rotary_dim {self.rotary_dim} needs {self.rotary_dim // 2}")

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (transformers' int(head_dim x factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longrope_factors(self) -> str | None:
        """For longrope, which of its factors the tables use ("short_factor" when
        `context_len` fits in `original_max_position_embeddings`, else "long_factor",
        as `sprig.kernels.rotary` chooses them); None for other rope types."""
        if not self.rope_scaling or self.rope_scaling.get("rope_type") != "longrope":
            return None
        fits = self.context_len <= self.rope_scaling["original_max_position_embeddings"]
        return "short_factor" if fits else "long_factor"

    def attention_window(self, layer_id: int) -> int | None:
        """The sliding window layer `layer_id` attends within; None: its whole context."""
        return self.sliding_window if layer_id in self.sliding_layers else None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, context_length: int | None = None, supported: Collection[str] | None = None
    ) -> ModelConfig:
        """Parse `path`/config.json; raises ValueError naming what is missing or unsupported
        (an architecture not in `supported`, when given: the model registry's names, which
        this module does not import), or a `context_length` the model cannot serve
        (`rope_config.longest_context`)."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model path {str(path)!r} is not a directory")
        cfg, image = _text_model(path, _read_json(path / "config.json", required=True))
        archs = cfg.get("architectures") or []
        if not archs or (supported is not None and archs[0] not in supported):
            raise ValueError(
                f"{path / 'config.json'}: unsupported architecture {archs[:1] or None}; "
                f"supported: {', '.join(supported or ())}"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"{path / 'config.json'}: hidden_act {act!r} is not one of {GATED_ACTIVATIONS}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{path / 'config.json'}: use_bidirectional_attention is not supported")
        num_heads = cfg["num_attention_heads"]
        gen = _read_json(path / "generation_config.json", required=False)
        eos = _as_ids(cfg.get("eos_token_id")) + _as_ids(gen.get("eos_token_id"))
        rope_theta, rope_scaling = read_rope(cfg)
        sliding_theta = None
        if archs[0] in PER_LAYER_TYPE_ROPE:
            rope_theta, rope_scaling, sliding_theta = layer_type_rope(cfg)
        window, sliding_layers = _sliding(cfg, archs[0])
        config = cls(
            architecture=archs[0] if image is None else cfg["multimodal_architecture"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            context_len=context_len(cfg, context_length),
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            quantization=_quantization(path / "config.json", cfg),
            moe=_moe(cfg),
            hidden_act=act,
            sliding_window=window,
            sliding_layers=sliding_layers,
            attention_scale=_attention_scale(cfg, archs[0]),
            sliding_rope_theta=sliding_theta,
            final_logit_softcap=cfg.get("final_logit_softcapping") or None,
            nope_layers=_nope_layers(cfg, archs[0]),
            **_granite_scalars(cfg, archs[0]),
            attention_softcap=cfg.get("attn_logit_softcapping") or None,
            image=image,
            partial_rotary_factor=partial_rotary_factor(cfg, archs[0]),
        )
        if config.longrope_factors is not None:
            log.info("longrope: context %d, original length %d: rotating with its %s", config.context_len,
                     config.rope_scaling["original_max_position_embeddings"], config.longrope_factors)
        return config


# families whose windowed layers are the ones config.json's `layer_types` marks (or, in
# older configs, the family's default pattern); Mistral, Mixtral and Qwen3-MoE apply a
# window to every layer; Llama has none
_LAYER_TYPED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                "Olmo3ForCausalLM", "SmolLM3ForCausalLM", "GptOssForCausalLM")
# families whose window counts only with `use_sliding_window`
_WINDOW_SWITCHED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                    "SmolLM3ForCausalLM")
_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")


# vision-language architectures -> the text model whose config.json keys theirs nests
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def _text_model(path: Path, cfg: dict[str, Any]) -> tuple[dict[str, Any], ImageSpec | None]:
    """config.json and no image spec, or for a vision-language checkpoint (`TEXT_MODELS`)
    its text model's config with every default filled in (such checkpoints save only a
    nested config's non-default values, so transformers reads it), the top-level dtype,
    head tying and stop tokens, `multimodal_architecture`, and how it takes images."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in TEXT_MODELS:
        return cfg, None
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(path)
    text = full.get_text_config().to_dict()
    top = {key: cfg[key] for key in ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id") if key in cfg}
    image = ImageSpec(
        token_id=full.image_token_id, begin_id=full.boi_token_id, end_id=full.eoi_token_id,
        tokens_per_image=full.mm_tokens_per_image, bidirectional=True, vision=full.vision_config.to_dict(),
    )
    return {**text, **top, "architectures": [TEXT_MODELS[arch]], "multimodal_architecture": arch}, image


def _sliding(cfg: dict[str, Any], arch: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that attend within it), as transformers reads config.json: the
    Qwen families' and SmolLM3's window counts only with `use_sliding_window`; without
    `layer_types`, Qwen2/Qwen3 slide in layers >= `max_window_layers`, Qwen2-MoE in the even
    layers below it, Gemma 2 in every other layer (the first included), Gemma 3 in all but
    every `sliding_window_pattern`-th layer, OLMo 3 in all but every fourth, SmolLM3 in its
    NoPE layers, gpt-oss in every other layer (the first included)."""
    window = cfg.get("sliding_window")
    if arch in _WINDOW_SWITCHED and not cfg.get("use_sliding_window", False):
        window = None
    if not window or arch not in _LAYER_TYPED + _EVERY_LAYER:
        return None, ()
    n = cfg["num_hidden_layers"]
    if arch in _EVERY_LAYER:
        layers = range(n)
    elif cfg.get("layer_types"):
        layers = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention"]
    elif arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        layers = [i for i in range(n) if (i + 1) % pattern]
    elif arch == "Olmo3ForCausalLM":
        layers = [i for i in range(n) if (i + 1) % 4]
    elif arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        layers = [i for i in range(n) if (i + 1) % 2]
    elif arch == "SmolLM3ForCausalLM":
        layers = _nope_layers(cfg, arch)
    elif arch == "Qwen2MoeForCausalLM":
        layers = [i for i in range(min(n, cfg.get("max_window_layers", 28))) if i % 2 == 0]
    else:
        layers = range(cfg.get("max_window_layers", 28), n)
    layers = tuple(layers)
    return (int(window), layers) if layers else (None, ())


def _attention_scale(cfg: dict[str, Any], arch: str) -> float | None:
    """The softmax scale where it is not head_dim ** -0.5: Gemma's
    query_pre_attn_scalar ** -0.5, Granite's attention_multiplier (1 by default)."""
    if arch == "GraniteForCausalLM":
        return float(cfg.get("attention_multiplier", 1.0))
    return cfg["query_pre_attn_scalar"] ** -0.5 if cfg.get("query_pre_attn_scalar") else None


def _granite_scalars(cfg: dict[str, Any], arch: str) -> dict[str, float]:
    """Granite's embedding and residual multipliers and logit divisor (1 by default)."""
    if arch != "GraniteForCausalLM":
        return {}
    return {key: float(cfg.get(key, 1.0)) for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}


def _nope_layers(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: where `no_rope_layers` (1 per layer with RoPE) has a 0,
    or, without it, every `no_rope_layer_interval`-th layer (4th by default)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    return tuple(i for i, has_rope in enumerate(flags) if not has_rope)


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    """The sparse blocks config.json describes: Mixtral's `num_local_experts` experts of
    `intermediate_size`, always renormalized, in every layer; or the Qwen MoE families'
    `num_experts` (saved as `num_local_experts` by some transformers versions) of
    `moe_intermediate_size`, in every `decoder_sparse_step`-th layer not in
    `mlp_only_layers`; or gpt-oss's `num_local_experts` of `intermediate_size`, in every
    layer, with its clamped SwiGLU (`swiglu_alpha`, 1.702 unless given, and `swiglu_limit`)
    and its experts in MXFP4 when `quantization_config` says so."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return None
    layers = cfg["num_hidden_layers"]
    if _is_gpt_oss(cfg):
        method = (cfg.get("quantization_config") or {}).get("quant_method")
        return MoEConfig(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                         expert_intermediate_size=cfg["intermediate_size"], renormalize=True,
                         clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
                         expert_format="mxfp4" if method == "mxfp4" else None)
    if "moe_intermediate_size" not in cfg:  # Mixtral
        return MoEConfig(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                         expert_intermediate_size=cfg["intermediate_size"], renormalize=True)
    step = cfg.get("decoder_sparse_step") or 1
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        dense_layers=tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step),
    )


def _is_gpt_oss(cfg: dict[str, Any]) -> bool:
    return (cfg.get("architectures") or [None])[0] == "GptOssForCausalLM"


def _quantization(file: Path, cfg: dict[str, Any]) -> WeightFormat | None:
    """The weight format of the checkpoint's linear layers; gpt-oss's MXFP4 quantizes only
    its experts (`MoEConfig.expert_format`), which `modules_to_not_convert` must confirm."""
    quantization_config = cfg.get("quantization_config")
    if not quantization_config:
        return None
    if quantization_config.get("quant_method") == "mxfp4":
        kept = quantization_config.get("modules_to_not_convert")
        if not _is_gpt_oss(cfg) or (kept is not None and not _only_experts_converted(kept)):
            raise ValueError(f"{file}: MXFP4 weights are supported for gpt-oss's experts only "
                             f"(modules_to_not_convert: {kept})")
        return None
    from sprig.runtime.quantization.formats import checkpoint_format

    try:
        return checkpoint_format(quantization_config)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def _only_experts_converted(kept: list[str]) -> bool:
    """Whether gpt-oss's `modules_to_not_convert` leaves every module but the experts in
    float: attention, router, embedding and head (with or without `model.`, as globs)."""
    names = {name.removeprefix("model.") for name in kept}
    return {"layers.*.self_attn", "layers.*.mlp.router", "embed_tokens", "lm_head"} <= names


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ValueError(f"{file.parent}: no {file.name} (not a Hugging Face checkpoint?)")
        return {}
    return json.loads(file.read_text())


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
