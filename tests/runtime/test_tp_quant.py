"""Quantized layers split over tensor-parallel ranks like float ones: online int4, GPTQ /
AWQ checkpoints, and both forms of Phi-3's fused q/k/v and gate/up tensors (online int8 of
Phi-4-mini's float ones, a GPTQ Phi-3's fused codes) at TP=2 give TP=1's greedy tokens,
logprobs within 1e-4 (each rank holds the codes and scales of the whole layer's
quantization, cut to its part); groups that a rank's inputs do not tile, and act-order
layers split by input, are refused naming the layer."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_checkpoints import Spec, quantize_checkpoint

from sprig.runtime import Engine

ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=1024)
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41]]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-quant")
    return {
        "gptq": quantize_checkpoint(tiny_checkpoints["qwen2"], root / "gptq", Spec("gptq", bits=4, group_size=32))[0],
        "awq": quantize_checkpoint(tiny_checkpoints["llama"], root / "awq", Spec("awq", sym=False))[0],
        "act_order": quantize_checkpoint(tiny_checkpoints["llama"], root / "ao", Spec("gptq", act_order=True))[0],
        "online": tiny_checkpoints["qwen2"],
        "fused": tiny_checkpoints["phi4_mini"],
        "gptq_fused": quantize_checkpoint(tiny_checkpoints["phi3"], root / "gptq_fused", Spec("gptq", 8, 32))[0],
    }


def generate(path: Path, **kwargs: object) -> list[dict]:
    with Engine(str(path), **ENGINE, **kwargs) as engine:
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("online", {"quantization": "int4", "quantization_group_size": 32}),
    ("fused", {"quantization": "int8"}),
    ("gptq_fused", {}),
    ("gptq", {}),
    ("awq", {}),
])
def test_quantized_tp2_matches_tp1(name: str, kwargs: dict, checkpoints: dict[str, Path]) -> None:
    expected = generate(checkpoints[name], **kwargs)
    got = generate(checkpoints[name], tp_size=2, **kwargs)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    for a, b in zip(got, expected, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            pairs = zip(a["meta_info"][key], b["meta_info"][key], strict=True)
            assert max(abs(x[0] - y[0]) for x, y in pairs if y[0] is not None) < 1e-4


def test_act_order_split_by_input_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="act-order"):
        generate(checkpoints["act_order"], tp_size=2)
