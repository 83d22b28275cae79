"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, written by a reference quantizer
from each format's documented layout) and online quantization, on every architecture:
sprig's logits equal transformers' on the float checkpoint the codes stand for, and greedy
decoding agrees token for token.

Tolerance: float32 activations, so the quantized kernels differ from transformers' dense
matmul only by summation order: ATOL 1e-4 on logits of magnitude ~5, as for float models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import contexts_step
from quant_checkpoints import (
    ATOL,
    Fp8Spec,
    Spec,
    check_matches_transformers,
    prompts,
    quantize_checkpoint,
    quantize_fp8_checkpoint,
    with_rtn_weights,
)
from transformers import AutoModelForCausalLM

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.quantization.weight import QuantScheme
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import ARCHITECTURES, build_tiny_checkpoint

EVERY_ARCH = [  # one of each format's families on every architecture
    Spec("gptq", 4, 32, sym=False, act_order=True),
    Spec("gptq", 8, None),
    Spec("awq", 4, 32, sym=False),
    Spec("compressed-tensors", 4, 32),
    Spec("compressed-tensors", 8, None, sym=False),
]
LLAMA_ONLY = [  # the other variants
    Spec("gptq", 4, 32),
    Spec("gptq", 4, 64, sym=False),
    Spec("gptq", 8, 32, sym=False, act_order=True, gptq_v2=True),
    Spec("gptq", 4, 32, sym=False, gptq_v2=True),
    Spec("awq", 4, 64, sym=False),
    Spec("compressed-tensors", 4, 64, sym=False),
    Spec("compressed-tensors", 4, 32, act_order=True),
    Spec("compressed-tensors", 8, None),
]
CASES = [(arch, spec) for spec in EVERY_ARCH for arch in ARCHITECTURES] + [("llama", s) for s in LLAMA_ONLY]
ONLINE = [(arch, m, 32) for m in ("int8", "int4") for arch in ARCHITECTURES] + [("llama", "int4", 64), ("llama", "fp8", 32)]
ONLINE_SCHEMES = {"int8": QuantScheme(8), "fp8": QuantScheme(8, float8=True)}
FP8_EVERY_ARCH = [Fp8Spec("fp8", "block"), Fp8Spec("compressed-tensors", "channel")]
FP8_LLAMA_ONLY = [Fp8Spec("fp8", "tensor", static=True), Fp8Spec("compressed-tensors", "tensor"),
                  Fp8Spec("compressed-tensors", "group"), Fp8Spec("compressed-tensors", "block", static=True)]
FP8_CASES = [(arch, spec) for spec in FP8_EVERY_ARCH for arch in ARCHITECTURES] + [("llama", s) for s in FP8_LLAMA_ONLY]


@pytest.fixture(scope="module")
def sharp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint per architecture with weights large enough that a wrong code,
    scale or zero moves the logits far past the tolerance (GQA; qwen2 has q/k/v biases;
    Granite keeps its other multipliers but not its logit divisor, which would shrink the
    logits below the tolerance's scale)."""
    root = tmp_path_factory.mktemp("quant-float")
    unscaled = {"granite": {"logits_scaling": 1.0}}
    return {arch: build_tiny_checkpoint(root / arch, arch, seed=5, initializer_range=0.2, **unscaled.get(arch, {}))
            for arch in ARCHITECTURES}


def _float_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _runner(path: Path, **kwargs) -> ModelRunner:
    return ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=256, **kwargs))


@pytest.mark.parametrize(("arch", "spec"), CASES, ids=[f"{s.label}-{a}" for a, s in CASES])
def test_checkpoint_format_matches_transformers(arch: str, spec: Spec, sharp: dict[str, Path], tmp_path: Path) -> None:
    quantized, dequantized = quantize_checkpoint(sharp[arch], tmp_path, spec)
    runner = _runner(quantized)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * runner.model_config.num_layers  # qkv, o, gate_up, down
    assert all(m.scheme == QuantScheme(spec.bits, spec.group_size, spec.sym) for m in layers)
    assert all((m.perm is not None) == (spec.act_order and m.num_groups > 1) for m in layers)
    hf = _float_hf(dequantized)
    float_hf = _float_hf(sharp[arch])
    ids = torch.tensor([prompts(runner.model_config.vocab_size)[0]])
    with torch.no_grad():  # the codes are really quantized: the float model differs
        assert (hf(ids).logits - float_hf(ids).logits).abs().max() > 100 * ATOL
    check_matches_transformers(runner, hf)


@pytest.mark.parametrize(("arch", "method", "group"), ONLINE, ids=[f"{m}-g{g}-{a}" if m == "int4" else f"{m}-{a}" for a, m, g in ONLINE])
def test_online_quantization_matches_transformers(arch: str, method: str, group: int, sharp: dict[str, Path]) -> None:
    runner = _runner(sharp[arch], quantization=method, quantization_group_size=group)
    scheme = ONLINE_SCHEMES.get(method, QuantScheme(4, group, symmetric=False))
    assert all(m.scheme == scheme for m in runner.model.modules() if isinstance(m, QuantizedLinear))
    check_matches_transformers(runner, with_rtn_weights(_float_hf(sharp[arch]), scheme))


@pytest.mark.parametrize(("arch", "spec"), FP8_CASES, ids=[f"{s.label}-{a}" for a, s in FP8_CASES])
def test_fp8_checkpoint_matches_transformers(arch: str, spec: Fp8Spec, sharp: dict[str, Path], tmp_path: Path) -> None:
    """FP8 weights (any scale layout; activations run unquantized) give transformers'
    logits on the float weights they stand for, and its greedy tokens."""
    quantized, dequantized = quantize_fp8_checkpoint(sharp[arch], tmp_path, spec)
    runner = _runner(quantized)
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * runner.model_config.num_layers and all(m.scheme.float8 for m in layers)
    assert all(m.matmul.codes.dtype == torch.float8_e4m3fn for m in layers)  # stored in 8 bits
    hf = _float_hf(dequantized)
    ids = torch.tensor([prompts(runner.model_config.vocab_size)[0]])
    with torch.no_grad():  # the weights are really rounded to e4m3: the float model differs
        assert (hf(ids).logits - _float_hf(sharp[arch])(ids).logits).abs().max() > 10 * ATOL
    check_matches_transformers(runner, hf)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden 128, so that groups of 128 inputs fit every layer."""
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("quant-wide") / "qwen2", "qwen2", seed=6, hidden_size=128,
        intermediate_size=256, initializer_range=0.1,
    )


@pytest.mark.parametrize(
    "spec", [Spec("gptq", 4, 128, sym=False, act_order=True), Spec("compressed-tensors", 4, 128)],
    ids=lambda s: s.label,
)
def test_groups_of_128(spec: Spec, wide: Path, tmp_path: Path) -> None:
    quantized, dequantized = quantize_checkpoint(wide, tmp_path, spec)
    check_matches_transformers(_runner(quantized), AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval())


def test_online_groups_of_128(wide: Path) -> None:
    runner = _runner(wide, quantization="int4", quantization_group_size=128)
    check_matches_transformers(runner, with_rtn_weights(_float_hf(wide), QuantScheme(4, 128, symmetric=False)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("spec", [Spec("gptq", 4, 32), Spec("compressed-tensors", 8, None, sym=False)],
                         ids=lambda s: s.label)
def test_half_activations_run_close_to_transformers(spec: Spec, dtype: str, sharp: dict[str, Path], tmp_path: Path) -> None:
    """The fast CPU path (bfloat16 or float16 activations, as GPTQ checkpoints name) is no
    worse than transformers' own run in that dtype."""
    quantized, dequantized = quantize_checkpoint(sharp["llama"], tmp_path, spec)
    runner = ModelRunner(RunnerConfig(quantized, dtype=dtype, device="cpu", max_total_tokens=64))
    ids = prompts(runner.model_config.vocab_size, lens=(9,))[0]
    logits = runner.forward(contexts_step(
        ForwardMode.EXTEND, ids, [9], [torch.arange(1, 10, dtype=torch.int32)], [0]
    ))
    with torch.no_grad():
        ref = _float_hf(dequantized)(torch.tensor([ids])).logits[0]
        hf_half = AutoModelForCausalLM.from_pretrained(dequantized, dtype=getattr(torch, dtype))
        hf_error = (hf_half(torch.tensor([ids])).logits[0].float() - ref).abs().max()
    assert (logits - ref).abs().max() <= 2 * hf_error + 1e-3
