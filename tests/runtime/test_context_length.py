"""`context_length` (`--context-length`): the longest context served, up to what the
checkpoint's rope config covers; past it, a ValueError naming the limit and its cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_model_config import BASE, write_config

from sprig.runtime import Engine
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.rope_config import longest_context
from sprig.runtime.runner_config import RunnerConfig


@pytest.mark.parametrize(
    ("extra", "limit", "why"),
    [
        ({}, 256, "max_position_embeddings 256"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 1024, "linear factor 4.0"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, 512, "linear factor 2.0"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}}, 256, "max_position_embeddings 256"),
        ({"sliding_window": 128}, 256, "max_position_embeddings 256"),  # sprig computes the window
        ({"architectures": ["Gemma3ForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 256,
         "max_position_embeddings 256"),  # Gemma 3's max_position_embeddings is the scaled length
    ],
)
def test_the_longest_context_follows_the_rope_config(tmp_path: Path, extra, limit, why) -> None:
    cfg = {**BASE, **extra}
    assert longest_context(cfg)[0] == limit and why in longest_context(cfg)[1]
    path = write_config(tmp_path, cfg)
    assert ModelConfig.from_pretrained(path).context_len == min(limit, 256)  # the default never stretches
    assert ModelConfig.from_pretrained(path, context_length=limit).context_len == limit
    assert ModelConfig.from_pretrained(path, context_length=100).context_len == 100
    with pytest.raises(ValueError, match=rf"context_length {limit + 1} exceeds .*: {limit} tokens \(.*{why}"):
        ModelConfig.from_pretrained(path, context_length=limit + 1)


def test_invalid_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="context_length must be >= 1"):
        RunnerConfig(model_path="/m", context_length=0)
    with pytest.raises(ValueError, match="positive integer"):
        ModelConfig.from_pretrained(write_config(tmp_path, BASE), context_length=-3)


def test_the_engine_serves_the_shorter_context(tiny_llama: Path) -> None:
    assert json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"] == 1024
    with Engine(tiny_llama, dtype="float32", context_length=64) as engine:
        assert engine.scheduler.context_len == 64
        out = engine.generate("the quick brown fox", {"max_new_tokens": 8, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 8
        with pytest.raises(ValueError, match="exceeds the model's context length 64"):
            engine.generate("the quick brown fox", {"max_new_tokens": 60})
    with pytest.raises(ValueError, match="exceeds the longest context this model supports: 1024 tokens"):
        Engine(tiny_llama, dtype="float32", context_length=2048)
