"""What sprig needs to know about a Hugging Face Llama-family checkpoint, read from its
config.json (and generation_config.json for the stop tokens)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sprig.runtime.quantization.formats import WeightFormat

# rope types sprig computes exactly as transformers does (see sprig.kernels.rotary)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward blocks of a mixture-of-experts checkpoint (Mixtral, Qwen2-MoE,
    Qwen3-MoE).

    Each token's router logits pick its `top_k` experts by softmax probability; their
    probabilities, renormalized to sum to 1 when `renormalize`, weight the experts'
    outputs. A shared expert (`shared_expert_intermediate_size` > 0, Qwen2-MoE) runs on
    every token, scaled by sigmoid of its own one-output gate. Layers in `dense_layers`
    keep a dense MLP of the model's `intermediate_size` instead.
    Invariants: 0 < top_k <= num_experts; expert_intermediate_size > 0.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.top_k}")
        if self.expert_intermediate_size <= 0:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.expert_intermediate_size}")


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's architecture and geometry.

    Invariants: `num_heads % num_kv_heads == 0`; `rope_scaling` is None for plain RoPE,
    else a dict with `rope_type` in ("linear", "llama3") and that type's parameters (for
    llama3 `original_max_position_embeddings` is always present); `context_len` is the
    longest context sprig serves: the checkpoint's `max_position_embeddings`, or the
    `context_length` asked of `from_pretrained`, never past what the rope config covers
    nor past a sliding window (sprig does not implement one, so it computes exactly only
    within it); `eos_token_ids` is the union of config.json's and
    generation_config.json's, in that order; `quantization` is the format config.json's
    `quantization_config` names (None for a float checkpoint); `moe` describes the sparse
    blocks of a mixture-of-experts model (None for a dense one).
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

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, context_length: int | None = None, supported: Collection[str] | None = None
    ) -> ModelConfig:
        """Parse `path`/config.json; raises ValueError naming what is missing or unsupported
        (an architecture not in `supported`, when given: the model registry's names, which
        this module does not import), or a `context_length` the model cannot serve
        (`longest_context`)."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model path {str(path)!r} is not a directory")
        cfg = _read_json(path / "config.json", required=True)
        archs = cfg.get("architectures") or []
        if not archs or (supported is not None and archs[0] not in supported):
            raise ValueError(
                f"{path / 'config.json'}: unsupported architecture {archs[:1] or None}; "
                f"supported: {', '.join(supported or ())}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path / 'config.json'}: hidden_act {cfg['hidden_act']!r} is not silu")
        num_heads = cfg["num_attention_heads"]
        gen = _read_json(path / "generation_config.json", required=False)
        eos = _as_ids(cfg.get("eos_token_id")) + _as_ids(gen.get("eos_token_id"))
        rope_theta, rope_scaling = _rope(cfg)
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            context_len=_context_len(cfg, context_length),
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            quantization=_quantization(path / "config.json", cfg.get("quantization_config")),
            moe=_moe(cfg),
        )


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    """The sparse blocks config.json describes: Mixtral's `num_local_experts` experts of
    `intermediate_size`, always renormalized, in every layer; or the Qwen MoE families'
    `num_experts` (saved as `num_local_experts` by some transformers versions) of
    `moe_intermediate_size`, in every `decoder_sparse_step`-th layer not in
    `mlp_only_layers`."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return None
    layers = cfg["num_hidden_layers"]
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


def _quantization(file: Path, quantization_config: dict[str, Any] | None) -> WeightFormat | None:
    if not quantization_config:
        return None
    from sprig.runtime.quantization.formats import checkpoint_format

    try:
        return checkpoint_format(quantization_config)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


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


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` (whose type key may be spelt `type`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling = {k: params[k] for k in _ROPE_KEYS if k in params} | {"rope_type": rope_type}
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return theta, scaling


def longest_context(cfg: dict[str, Any]) -> tuple[int, str]:
    """The longest context a checkpoint's config covers, and why: max_position_embeddings,
    times the factor of linear rope scaling (which stretches positions; llama3 scaling's
    max_position_embeddings is already the stretched length), capped by a sliding window
    when one is in use."""
    limit = cfg["max_position_embeddings"]
    why = f"max_position_embeddings {limit}"
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) == "linear":
        limit = int(limit * params["factor"])
        why += f" x rope_scaling linear factor {params['factor']}"
    window = cfg.get("sliding_window")
    if "layer_types" in cfg:
        sliding = "sliding_attention" in cfg["layer_types"]
    else:
        sliding = cfg.get("use_sliding_window", True)
    if sliding and window and window < limit:
        limit, why = window, f"its sliding window of {window} tokens (sprig computes attention only within one)"
    return limit, why


def _context_len(cfg: dict[str, Any], requested: int | None) -> int:
    """max_position_embeddings (capped by the sliding window), or `requested` if it is
    within `longest_context`."""
    limit, why = longest_context(cfg)
    if requested is None:
        return min(cfg["max_position_embeddings"], limit)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"context_length must be a positive integer, got {requested!r}")
    if requested > limit:
        raise ValueError(f"context_length {requested} exceeds the longest context this model supports: "
                         f"{limit} tokens ({why})")
    return requested
