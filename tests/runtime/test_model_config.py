"""ModelConfig parsing: transformers 5.x checkpoints, older config.json spellings, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import supported_architectures

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "max_position_embeddings": 256,
}


def write_config(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_tiny_checkpoints_parse(tiny_checkpoints: dict[str, Path]) -> None:
    configs = {arch: ModelConfig.from_pretrained(p) for arch, p in tiny_checkpoints.items()}
    assert {c.architecture for c in configs.values()} == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
        "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "Gemma2ForCausalLM",
        "GptOssForCausalLM", "Phi3ForCausalLM",
    }
    assert all((c.moe is None) == (arch in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "olmo3",
                                            "smollm3", "granite", "phi3", "phi4_mini"))
               for arch, c in configs.items())
    phi4_mini = configs["phi4_mini"]
    assert (phi4_mini.rotary_dim, phi4_mini.longrope_factors, phi4_mini.tie_word_embeddings) == (12, "short_factor", True)
    assert configs["phi3"].rotary_dim == 16 and configs["phi3"].rope_scaling is None
    assert configs["smollm3"].nope_layers == (1,) and all(c.nope_layers == () for a, c in configs.items() if a != "smollm3")
    assert (configs["gemma2"].attention_softcap, configs["gemma2"].final_logit_softcap) == (1.5, 4.0)
    gemma = configs["gemma3"]
    assert (gemma.sliding_window, gemma.sliding_layers, gemma.hidden_act) == (8, (0,), "gelu_pytorch_tanh")
    assert gemma.attention_scale == 24**-0.5 and gemma.sliding_rope_theta == 10_000.0
    c = configs["qwen2"]  # no head_dim key in a Qwen2 config: hidden / heads
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (4, 2, 16, 2)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (64, 128, 512)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.context_len == 1024 and c.rms_norm_eps == 1e-5
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert c.torch_dtype == "float32" and not c.tie_word_embeddings
    hash(c)  # frozen and hashable, rope_scaling excluded


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    c = ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "rope_parameters": rope}))
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_legacy_rope_scaling_and_dtype_and_eos_lists(tmp_path: Path) -> None:
    config = {
        **BASE, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16", "num_key_value_heads": 2, "head_dim": 32,
        "eos_token_id": [5, 6], "tie_word_embeddings": True,
    }
    c = ModelConfig.from_pretrained(write_config(tmp_path, config, {"eos_token_id": [6, 7]}))
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.torch_dtype == "bfloat16" and c.head_dim == 32 and c.num_kv_heads == 2
    assert c.eos_token_ids == (5, 6, 7) and c.tie_word_embeddings


def test_llama3_original_max_defaults_to_max_positions(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    c = ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "rope_scaling": rope}))
    assert c.rope_scaling["original_max_position_embeddings"] == 256


@pytest.mark.parametrize(
    ("arch", "extra", "window", "layers"),
    [
        ("MistralForCausalLM", {"sliding_window": 100}, 100, (0, 1, 2, 3)),  # Mistral v0.1: every layer
        ("MistralForCausalLM", {"sliding_window": None}, None, ()),
        ("MixtralForCausalLM", {"sliding_window": 100}, 100, (0, 1, 2, 3)),
        ("LlamaForCausalLM", {"sliding_window": 100}, None, ()),  # Llama has none
        ("Qwen2ForCausalLM", {"sliding_window": 100, "use_sliding_window": False}, None, ()),  # Qwen2.5's
        ("Qwen2ForCausalLM", {"sliding_window": 100, "use_sliding_window": True, "max_window_layers": 1}, 100,
         (1, 2, 3)),
        ("Qwen3ForCausalLM", {"sliding_window": 100, "use_sliding_window": True,
                              "layer_types": ["full_attention", "sliding_attention"] * 2}, 100, (1, 3)),
        ("Qwen2MoeForCausalLM", {"sliding_window": 100, "use_sliding_window": True, "max_window_layers": 3}, 100,
         (0, 2)),
        ("Qwen3MoeForCausalLM", {"sliding_window": 100, "use_sliding_window": True}, 100, (0, 1, 2, 3)),
        ("Gemma3ForCausalLM", {"sliding_window": 100, "sliding_window_pattern": 2}, 100, (0, 2)),
        ("Gemma3ForCausalLM", {"sliding_window": 100, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
         100, (0, 1, 2)),
        ("Gemma3ForCausalLM", {"sliding_window": 100, "layer_types": ["full_attention"] * 4}, None, ()),
        ("Olmo3ForCausalLM", {"sliding_window": 100}, 100, (0, 1, 2)),
        ("Gemma2ForCausalLM", {"sliding_window": 100}, 100, (0, 2)),
        ("Olmo2ForCausalLM", {"sliding_window": 100}, None, ()),
        ("SmolLM3ForCausalLM", {"sliding_window": 100}, None, ()),
        ("SmolLM3ForCausalLM", {"sliding_window": 100, "use_sliding_window": True}, 100, (3,)),  # its NoPE layer
    ],
)
def test_sliding_window_layers_as_transformers_reads_them(
    tmp_path: Path, arch: str, extra: dict, window: int | None, layers: tuple[int, ...]
) -> None:
    cfg = {**BASE, "architectures": [arch], "num_hidden_layers": 4, **extra}
    if "Moe" in arch or "Mixtral" in arch:
        cfg |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    c = ModelConfig.from_pretrained(write_config(tmp_path, cfg))
    assert (c.sliding_window, c.sliding_layers) == (window, layers)
    assert [c.attention_window(i) for i in range(4)] == [window if i in layers else None for i in range(4)]
    assert c.context_len == 256  # sprig computes the window: it no longer caps the context


def test_gemma3_reads_both_ropes_and_its_scales(tmp_path: Path) -> None:
    gemma = {**BASE, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
             "query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0, "sliding_window": 512}
    older = {**gemma, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    newer = {**gemma, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for cfg in (older, newer):
        c = ModelConfig.from_pretrained(write_config(tmp_path, cfg))
        assert (c.rope_theta, c.rope_scaling, c.sliding_rope_theta) == (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
        assert (c.hidden_act, c.attention_scale, c.final_logit_softcap) == ("gelu_pytorch_tanh", 256**-0.5, 30.0)
        assert c.sliding_layers == (0, 1) and c.context_len == 256
    with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
        ModelConfig.from_pretrained(write_config(tmp_path, {**newer, "use_bidirectional_attention": True}))
    assert c.attention_softcap is None
    assert ModelConfig.from_pretrained(write_config(tmp_path, {**newer, "attn_logit_softcapping": 50.0})).attention_softcap == 50.0
    with pytest.raises(ValueError, match="hidden_act 'relu' is not one of"):
        ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "hidden_act": "relu"}))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM, "):
        ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "architectures": ["GPT2LMHeadModel"]}),
                                    supported=supported_architectures())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "unsupported rope_type 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)
def test_unsupported_configs(tmp_path: Path, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, **extra}))


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "Olmo3ForCausalLM"])
@pytest.mark.parametrize("rope", [
    {"rope_theta": 20_000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_theta": 20_000.0, "rope_local_base_freq": 300.0},
    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 7e5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 900.0}}},
    {},
])
def test_per_layer_type_ropes_read_as_transformers_reads_them(tmp_path: Path, arch: str, rope: dict) -> None:
    """Both RoPEs, in either config format, as transformers' own config class resolves them
    (its defaults, and its quirks: OLMo 3's older format gives the sliding layers the family
    default theta, not `rope_theta`)."""
    from transformers import Gemma3TextConfig, Olmo3Config

    cfg = {**BASE, "architectures": [arch], "sliding_window": 16, **rope}
    c = ModelConfig.from_pretrained(write_config(tmp_path, cfg))
    hf = {"Gemma3ForCausalLM": Gemma3TextConfig, "Olmo3ForCausalLM": Olmo3Config}[arch](
        **{k: v for k, v in cfg.items() if k != "architectures"}).rope_parameters
    full, local = hf["full_attention"], hf["sliding_attention"]
    assert (c.rope_theta, c.sliding_rope_theta) == (full["rope_theta"], local["rope_theta"])
    assert local["rope_type"] == "default"
    assert (c.rope_scaling or {"rope_type": "default"})["rope_type"] == full["rope_type"]
    if c.rope_scaling is not None:
        assert c.rope_scaling["factor"] == full["factor"]


@pytest.mark.parametrize(("extra", "nope"), [
    ({}, (3, 7)),  # every fourth layer by default
    ({"no_rope_layer_interval": 3}, (2, 5)),
    ({"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]}, (1, 4)),
])
def test_smollm3_nope_layers(tmp_path: Path, extra: dict, nope: tuple[int, ...]) -> None:
    cfg = {**BASE, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8, **extra}
    assert ModelConfig.from_pretrained(write_config(tmp_path, cfg)).nope_layers == nope
    assert ModelConfig.from_pretrained(write_config(tmp_path, {**cfg, "architectures": ["LlamaForCausalLM"]})).nope_layers == ()


def test_granite_scalars(tmp_path: Path) -> None:
    granite = {**BASE, "architectures": ["GraniteForCausalLM"], "embedding_multiplier": 12.0,
               "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 16.0}
    c = ModelConfig.from_pretrained(write_config(tmp_path, granite))
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (12.0, 0.22, 0.0078125, 16.0)
    c = ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "architectures": ["GraniteForCausalLM"]}))
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_scale, c.logits_scaling) == (1.0, 1.0, 1.0, 1.0)
    llama = ModelConfig.from_pretrained(write_config(tmp_path, {**granite, "architectures": ["LlamaForCausalLM"]}))
    assert (llama.embedding_multiplier, llama.residual_multiplier, llama.attention_scale, llama.logits_scaling) == (
        1.0, 1.0, None, 1.0)  # only Granite reads them
