"""Quantized checkpoints that do not load: a clear start-up error naming the method, the
option or the tensor. And layers a checkpoint leaves in float."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import Spec, check_matches_transformers, quantize_checkpoint
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qf") / "qwen2", "qwen2", seed=2, initializer_range=0.2)


def _runner(path: Path, **kwargs) -> ModelRunner:
    return ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=256, **kwargs))


def _with_config(path: Path, quantization_config: dict) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quantization method 'bitsandbytes' is not supported; supported: gptq, awq, compressed-tensors, fp8"),
        ({"quant_method": "fp8", "activation_scheme": "per-layer"}, r"fp8 activation_scheme 'per-layer' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fp8 fmt 'e5m2' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"a weight block is \[rows, columns\]"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": CT_GROUP}},
         r"group g: float-quantized stores float weights"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}}}, r"float weights of 4 bits"),
        ({**GPTQ, "bits": 3}, r"GPTQ with bits=3 is not supported"),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"GPTQ checkpoint_format 'marlin' is not supported"),
        ({**GPTQ, "lm_head": True}, r"quantized lm_head"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, r"AWQ version 'gemv' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"g": CT_GROUP}},
         r"compressed-tensors format 'naive-quantized' \(group g\) is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {**CT_GROUP, "input_activations": {"num_bits": 8}}}}, r"activation quantization"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "tensor"}}}},
         r"strategy 'tensor' \(group g\) is not supported"),
    ],
)
def test_unsupported_quantization_is_a_startup_error(quantization_config: dict, message: str, base: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text((base / "config.json").read_text())
    _with_config(path, quantization_config)
    with pytest.raises(ValueError, match=message) as e:
        ModelConfig.from_pretrained(path)
    assert "config.json" in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "int3"}, r"quantization must be one of \('int8', 'int4', 'fp8'\), got 'int3'"),
        ({"quantization": "int4", "quantization_group_size": 100}, r"quantization_group_size must be one of \(32, 64, 128\)"),
    ],
)
def test_runner_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunnerConfig("model", **kwargs)


def test_group_size_must_divide_each_layer(base: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: quantization group size 128 "
                       r"does not divide in_features 64"):
        _runner(base, quantization="int4", quantization_group_size=128)


def test_online_quantization_of_a_quantized_checkpoint(base: Path, tmp_path: Path) -> None:
    quantized, _ = quantize_checkpoint(base, tmp_path, Spec("gptq", 4, 32))
    with pytest.raises(ValueError, match=r"already quantized \(gptq\); online quantization \(int8\) applies to float"):
        _runner(quantized, quantization="int8")


def _edit(path: Path, edit) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_missing_quantized_tensor(base: Path, tmp_path: Path) -> None:
    quantized, _ = quantize_checkpoint(base, tmp_path, Spec("gptq", 4, 32, sym=False))
    _edit(quantized, lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_proj\.qzeros$"):
        _runner(quantized)


def test_float_weight_in_a_quantized_layer_is_unexpected(base: Path, tmp_path: Path) -> None:
    quantized, _ = quantize_checkpoint(base, tmp_path, Spec("awq", 4, 32, sym=False))
    _edit(quantized, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        _runner(quantized)


def test_misshapen_quantized_tensor(base: Path, tmp_path: Path) -> None:
    quantized, _ = quantize_checkpoint(base, tmp_path, Spec("compressed-tensors", 4, 32))
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    _edit(quantized, lambda t: t.update({name: t[name][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=rf"tensor '{name}': weight_scale has shape \[128, 1\], the format expects \[128, 2\]"):
        _runner(quantized)


def test_fused_shards_with_different_g_idx(base: Path, tmp_path: Path) -> None:
    quantized, _ = quantize_checkpoint(base, tmp_path, Spec("gptq", 4, 32, act_order=True))
    name = "model.layers.0.self_attn.v_proj.g_idx"
    _edit(quantized, lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ValueError, match=r"v_proj\.g_idx'?: the fused shards of this layer have different g_idx"):
        _runner(quantized)


@pytest.mark.parametrize(
    "spec",
    [Spec("compressed-tensors", 4, 32, keep_float=("down_proj",)), Spec("awq", 4, 32, sym=False, keep_float=("o_proj",))],
    ids=lambda s: s.label,
)
def test_layers_left_in_float(spec: Spec, base: Path, tmp_path: Path) -> None:
    quantized, dequantized = quantize_checkpoint(base, tmp_path, spec)
    runner = _runner(quantized)
    kept = [m for n, m in runner.model.named_modules() if n.endswith(spec.keep_float[0])]
    assert kept and all(type(m) is nn.Linear for m in kept)
    assert sum(isinstance(m, QuantizedLinear) for m in runner.model.modules()) == 3 * runner.model_config.num_layers
    check_matches_transformers(runner, AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval())
