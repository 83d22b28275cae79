"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) beyond the shared parity suites: the longrope choice
(short factors when the served context fits the original length, long ones past it) against
transformers, how config.json maps onto `ModelConfig`, loading the fused checkpoint
tensors (float, and quantized checkpoints whose fused codes and scales are converted whole,
then cut into shards), and the Triton attention backend through the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_idle_and_intact, contexts_step, hf_greedy, make_prompts
from quant_checkpoints import (
    Fp8Spec,
    Spec,
    check_matches_transformers,
    quantize_checkpoint,
    quantize_fp8_checkpoint,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sprig.runtime import Engine
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.models import supported_architectures
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint, longrope_parameters

ORIGINAL = 16  # the longrope checkpoint's original_max_position_embeddings (max_position_embeddings 64)
ATOL = 1e-4


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-4-mini in miniature: partial longrope over an original length of 16 stretched to
    64 (factor left null: transformers' ratio, 4), a tied head, sharp attention."""
    rope = longrope_parameters(12)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("phi") / "longrope", "phi4_mini", seed=2,
                                 max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
                                 rope_parameters=rope, initializer_range=0.2)


def _runner(path: Path, context_length: int | None) -> ModelRunner:
    return ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=256,
                                    context_length=context_length))


def _prefill(runner: ModelRunner, batch: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's prefill logits `[len, V]`, all prompts in one step."""
    lens = [len(p) for p in batch]
    slots = torch.arange(1, 1 + sum(lens), dtype=torch.int32).split(lens)
    step = contexts_step(ForwardMode.EXTEND, [t for p in batch for t in p], lens, list(slots), [0] * len(batch))
    return list(runner.forward(step).split(lens))


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:  # one forward over the whole sequence
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ids(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def test_short_factors_within_the_original_length_equal_transformers(longrope: Path) -> None:
    """Every sequence the context holds stays within the original length, where
    transformers also rotates with the short factors: prefill and greedy decoding equal it."""
    runner = _runner(longrope, ORIGINAL)
    assert runner.model_config.longrope_factors == "short_factor"
    hf = AutoModelForCausalLM.from_pretrained(longrope, dtype=torch.float32).eval()
    batch = _ids((7, 1, 16, 4), seed=0)
    for got, ids in zip(_prefill(runner, batch), batch, strict=True):
        torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=0)
    prompt = batch[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=ORIGINAL - len(prompt), do_sample=False,
                          pad_token_id=0)[0].tolist()
    for n in range(len(prompt), len(ref)):  # each greedy step is the argmax of the prefix's last logits
        assert _prefill(runner, [ref[:n]])[0][-1].argmax().item() == ref[n]


def test_long_factors_past_the_original_length_equal_transformers_there(longrope: Path) -> None:
    """A context past the original length rotates every position with the long factors:
    equal to transformers' one forward over a sequence longer than the original length,
    and (unlike transformers, which switches by the forward's length) the same whether a
    prompt runs beside a long one or alone."""
    runner = _runner(longrope, None)
    assert runner.model_config.context_len == 64 and runner.model_config.longrope_factors == "long_factor"
    hf = AutoModelForCausalLM.from_pretrained(longrope, dtype=torch.float32).eval()
    long, short = _ids((40, 9), seed=1)
    got_long, got_short = _prefill(runner, [long, short])
    torch.testing.assert_close(got_long, _hf_logits(hf, long), atol=ATOL, rtol=0)
    torch.testing.assert_close(_prefill(runner, [short])[0], got_short, atol=1e-5, rtol=0)
    assert (got_short - _hf_logits(hf, short)).abs().max() > 1e-2  # transformers took its short factors
    short_runner = _runner(longrope, ORIGINAL)
    assert (short_runner.model.model.rotary.cos - runner.model.model.rotary.cos[:ORIGINAL]).abs().max() > 1e-3


def test_triton_attention_through_the_engine(tiny_checkpoints: dict[str, Path]) -> None:
    """Partial longrope with a tied head, with the Triton backend (the interpreter on CPU)."""
    path = tiny_checkpoints["phi4_mini"]
    prompts = make_prompts(3, seed=5)
    expected = hf_greedy(path, prompts, 4)
    options = {"attention_backend": "triton", "chunked_prefill_size": 6, "check_integrity": True}
    with Engine(path, dtype="float32", **options) as engine:
        outs = engine.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
        assert [o["output_ids"] for o in outs] == expected
        assert_idle_and_intact(engine)


def _config(tmp_path: Path, **keys: Any) -> ModelConfig:
    cfg = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, **keys}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(tmp_path, supported=supported_architectures())


def test_config_maps_as_transformers_reads_it(tmp_path: Path) -> None:
    window = _config(tmp_path, sliding_window=2047)  # Phi-3-mini-4k: every layer
    assert window.sliding_layers == (0, 1) and window.attention_window(1) == 2047
    assert window.rope_scaling is None and window.rotary_dim == 16
    legacy = _config(tmp_path, max_position_embeddings=131072, partial_rotary_factor=0.75,
                     rope_scaling={"type": "su", **longrope_parameters(12)})
    assert legacy.rope_scaling["rope_type"] == "longrope" and legacy.rotary_dim == 12
    assert legacy.rope_scaling["original_max_position_embeddings"] == 4096  # Phi-3's default
    assert legacy.rope_scaling["factor"] == 32 and legacy.longrope_factors == "long_factor"
    fits = _config(tmp_path, max_position_embeddings=8192, original_max_position_embeddings=1024,
                   rope_parameters={**longrope_parameters(8), "partial_rotary_factor": 0.5})
    assert fits.rotary_dim == 8 and fits.longrope_factors == "long_factor"
    served = ModelConfig.from_pretrained(tmp_path, context_length=1024)
    assert served.longrope_factors == "short_factor"
    with pytest.raises(ValueError, match="context_length 8193 exceeds"):
        ModelConfig.from_pretrained(tmp_path, context_length=8193)


@pytest.mark.parametrize(("keys", "message"), [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8}}, "needs both short_factor and long_factor"),
    ({"rope_scaling": longrope_parameters(6)}, "short_factor has 3 entries; rotary_dim 16 needs 8"),
    ({"partial_rotary_factor": 0.05}, "partial_rotary_factor 0.05"),
], ids=["unknown-type", "missing-factors", "factor-length", "rotates-nothing"])
def test_config_errors_name_what_is_unsupported(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **keys)


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["phi3"], broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{name}': has 112 rows, the fused layer stacks"):
        _runner(broken, None)


def test_online_int8_takes_the_fused_tensors_shard_by_shard(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["phi4_mini"]
    ids = _ids((20,), seed=3)
    (ref,) = _prefill(_runner(path, None), ids)
    quantized = ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=256,
                                         quantization="int8"))
    assert type(quantized.model.model.layers[0].self_attn.qkv_proj).__name__ == "QuantizedLinear"
    (got,) = _prefill(quantized, ids)
    assert 0 < (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.fixture(scope="module")
def sharp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights large enough that a wrong code, scale or zero point moves the logits far."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("phi") / "sharp", "phi3", seed=5, initializer_range=0.2)


@pytest.mark.parametrize("spec", [
    Spec("gptq", 4, 32, sym=False, act_order=True),
    Spec("awq", 4, 32, sym=False),
    Spec("compressed-tensors", 8, None, sym=False),
    Fp8Spec("fp8", "block"),  # blocks of 24 rows: they straddle the q/k/v boundaries
], ids=lambda spec: spec.label)
def test_quantized_fused_checkpoints_equal_transformers(spec: Spec | Fp8Spec, sharp: Path, tmp_path: Path) -> None:
    """A quantized Phi-3 stores each fused layer's codes, scales and zero points as one
    layer's (`qkv_proj.qweight`, ...): sprig's logits and greedy tokens equal transformers'
    on the float checkpoint the codes stand for."""
    write = quantize_fp8_checkpoint if isinstance(spec, Fp8Spec) else quantize_checkpoint
    quantized, dequantized = write(sharp, tmp_path, spec)
    names = load_file(quantized / "model.safetensors").keys()
    assert any(".qkv_proj." in n for n in names) and not any(".q_proj." in n for n in names)
    runner = _runner(quantized, None)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * runner.model_config.num_layers  # qkv, o, gate_up, down
    check_matches_transformers(runner, AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval())
