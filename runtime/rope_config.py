"""How a Hugging Face config.json describes RoPE and the context a checkpoint covers, as
transformers reads it: the rope type and its parameters (`read_rope`), the two RoPEs of the
families whose sliding layers have their own (`layer_type_rope`), the fraction of each head
rotated (`partial_rotary_factor`), and the longest context the config allows
(`longest_context`, `context_len`)."""

from __future__ import annotations

from typing import Any

# rope types sprig computes exactly as transformers does (see sprig.kernels.rotary)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ROPE_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
              "short_factor", "long_factor")
# rope types whose dict carries the pretraining length `original_max_position_embeddings`
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")
# families that read config.json as Phi-3 does: a top-level `original_max_position_embeddings`
# (4096 when absent) over the rope dict's, rope types "su" and "yarn" meaning longrope, and
# `partial_rotary_factor` (top level or in the rope dict) rotating part of each head
PHI3_STYLE = ("Phi3ForCausalLM",)
# families whose sliding layers have a RoPE of their own (`layer_type_rope`) -> the default
# theta of their full and of their sliding layers, and the older configs' key for the latter
PER_LAYER_TYPE_ROPE = {"Gemma3ForCausalLM": (1_000_000.0, 10_000.0, "rope_local_base_freq"),
                        "Olmo3ForCausalLM": (500_000.0, 500_000.0, None)}


def _full_layer_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with the full layers' RoPE as its `rope_parameters`, for a family whose
    sliding layers have their own (transformers 5's `rope_parameters` keyed by layer type,
    or the older `rope_theta` and `rope_scaling`)."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or cfg.get("rope_scaling") or {}
    default_theta = PER_LAYER_TYPE_ROPE[cfg["architectures"][0]][0]
    return {**cfg, "rope_parameters": {"rope_theta": cfg.get("rope_theta", default_theta)} | full}


def layer_type_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """The two RoPEs of Gemma 3 and OLMo 3: (full layers' theta, their scaling, sliding
    layers' theta; Gemma's older configs name it `rope_local_base_freq`, OLMo's older ones
    leave it at the family's default, as transformers reads them). The sliding layers' RoPE
    is never scaled."""
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_type {local.get('rope_type')!r} for the sliding layers")
    theta, scaling = read_rope(_full_layer_rope(cfg))
    _, default_local, older_key = PER_LAYER_TYPE_ROPE[cfg["architectures"][0]]
    older = cfg.get(older_key, default_local) if older_key else default_local
    return theta, scaling, float(local.get("rope_theta", older))


def read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5.x `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling` (whose type key may be spelt `type`; Phi-3's
    "su" and "yarn" are longrope, as transformers reads them).

    As transformers fills them for llama3, yarn and longrope: `original_max_position_embeddings`
    is a top-level one when config.json has it (Phi-3 style; a Phi-3 config's default is
    4096), else the dict's, else `max_position_embeddings`; a yarn or longrope `factor` left
    null (DeepSeek and Phi-3 style) is max_position_embeddings / original_max_position_embeddings."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    phi3 = (cfg.get("architectures") or [None])[0] in PHI3_STYLE
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling = {k: params[k] for k in _ROPE_KEYS if k in params} | {"rope_type": rope_type}
    if rope_type in _ORIGINAL_LENGTH_TYPES:
        top = cfg.get("original_max_position_embeddings", 4096 if phi3 else None)
        original = top or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or cfg["max_position_embeddings"]
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    if rope_type == "longrope" and not ({"short_factor", "long_factor"} <= scaling.keys()):
        raise ValueError("longrope rope scaling needs both short_factor and long_factor")
    return theta, scaling


def partial_rotary_factor(cfg: dict[str, Any], arch: str) -> float:
    """The fraction of each head RoPE rotates: a Phi-3-style config's `partial_rotary_factor`
    (the rope dict's over the top-level one, as transformers reads them); 1 elsewhere."""
    if arch not in PHI3_STYLE:
        return 1.0
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def longest_context(cfg: dict[str, Any]) -> tuple[int, str]:
    """The longest context a checkpoint's config covers, and why: max_position_embeddings,
    times the factor of linear rope scaling (which stretches positions; llama3 scaling's
    max_position_embeddings is already the stretched length, as is Gemma 3's, whose linear
    factor scales its full layers' RoPE). A family whose sliding layers have a RoPE of their
    own is read by its full layers' RoPE.

    For yarn it is the larger of max_position_embeddings and original_max_position_embeddings
    x factor (as `read_rope` fills them): the length yarn stretches the pretraining context to,
    as vLLM derives it, which Qwen2.5/Qwen3 configs (max_position_embeddings 32768/40960,
    yarn x4 over 32768) need for their 131072 tokens; a config whose max_position_embeddings
    already is at least that (DeepSeek-V3: 163840 = 4096 x 40) keeps it."""
    limit = cfg["max_position_embeddings"]
    why = f"max_position_embeddings {limit}"
    arch = (cfg.get("architectures") or [None])[0]
    if arch in PER_LAYER_TYPE_ROPE:  # the full layers' RoPE sets the limit
        cfg = _full_layer_rope(cfg)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type == "linear" and arch != "Gemma3ForCausalLM":
        limit = int(limit * params["factor"])
        why += f" x rope_scaling linear factor {params['factor']}"
    elif rope_type == "yarn":
        _, scaling = read_rope(cfg)
        original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        if int(original * factor) > limit:
            limit = int(original * factor)
            why = f"rope_scaling yarn original_max_position_embeddings {original} x factor {factor}"
    return limit, why


def context_len(cfg: dict[str, Any], requested: int | None) -> int:
    """max_position_embeddings, or `requested` if it is within `longest_context`."""
    limit, why = longest_context(cfg)
    if requested is None:
        return min(cfg["max_position_embeddings"], limit)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"context_length must be a positive integer, got {requested!r}")
    if requested > limit:
        raise ValueError(f"context_length {requested} exceeds the longest context this model supports: "
                         f"{limit} tokens ({why})")
    return requested
