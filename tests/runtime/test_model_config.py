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
        "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    }
    assert all((c.moe is None) == (arch in ("llama", "mistral", "qwen2", "qwen3")) for arch, c in configs.items())
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
    ("extra", "context_len"),
    [
        ({"sliding_window": 100}, 100),  # Mistral v0.1 style: window applies
        ({"sliding_window": 100, "use_sliding_window": False}, 256),  # Qwen2 4.x style
        ({"sliding_window": 100, "layer_types": ["full_attention"] * 2}, 256),
        ({"sliding_window": 100, "layer_types": ["sliding_attention"] * 2}, 100),
        ({"sliding_window": None}, 256),
    ],
)
def test_context_len_capped_by_sliding_window(tmp_path: Path, extra: dict, context_len: int) -> None:
    assert ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, **extra})).context_len == context_len


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
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)
def test_unsupported_configs(tmp_path: Path, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, **extra}))
