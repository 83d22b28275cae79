"""YaRN rope scaling: config.json parsing, the longest context it covers, and the model
runner and engine against transformers at positions past original_max_position_embeddings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import contexts_step
from test_model_config import BASE, write_config
from test_model_parity import ATOL, ArangeSlots, hf_logits, prompts
from transformers import AutoConfig, AutoModelForCausalLM

from sprig.runtime import Engine
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.rope_config import longest_context
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_yarn_keys_parse_from_rope_parameters_and_legacy_rope_scaling(tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "attention_factor": None,
            "truncate": False}
    c = ModelConfig.from_pretrained(write_config(tmp_path, {**BASE, "rope_parameters": rope}))
    assert c.rope_theta == 1e6
    assert c.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    legacy = {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 2, "unknown": 1}}
    c = ModelConfig.from_pretrained(write_config(tmp_path, legacy))
    assert c.rope_theta == 5e5  # the original length defaults to max_position_embeddings
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 256}


def test_yarn_fills_what_transformers_fills(tmp_path: Path) -> None:
    top = {**BASE, "original_max_position_embeddings": 32,  # Phi-3 style: wins over the dict's
           "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_pretrained(write_config(tmp_path, top)).rope_scaling["original_max_position_embeddings"] == 32
    null_factor = {**BASE, "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_pretrained(write_config(tmp_path, null_factor)).rope_scaling["factor"] == 4.0
    for cfg in (top, null_factor):  # the same numbers transformers' model computes with
        hf = AutoConfig.for_model("llama", **cfg)
        hf.standardize_rope_params()
        sprig = ModelConfig.from_pretrained(write_config(tmp_path, cfg)).rope_scaling
        assert hf.rope_parameters["original_max_position_embeddings"] == sprig["original_max_position_embeddings"]
        assert (hf.rope_parameters["factor"] or 256 / 64) == sprig["factor"]


@pytest.mark.parametrize(
    ("extra", "limit", "why"),
    [
        # Qwen2.5 / Qwen3 with the yarn block their model cards add: stretched to 128k
        ({"max_position_embeddings": 32768, "rope_scaling": QWEN_YARN}, 131072, "32768 x factor 4.0"),
        ({"max_position_embeddings": 40960, "rope_parameters": {**QWEN_YARN, "rope_theta": 1e6}}, 131072,
         "original_max_position_embeddings 32768 x factor 4.0"),
        # DeepSeek-V3: max_position_embeddings already is the stretched length
        ({"max_position_embeddings": 163840, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}, 163840, "max_position_embeddings 163840"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}}, 256,
         "max_position_embeddings 256"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 512, "256 x factor 2.0"),  # original: 256
    ],
)
def test_the_longest_yarn_context(tmp_path: Path, extra: dict, limit: int, why: str) -> None:
    cfg = {**BASE, **extra}
    got, reason = longest_context(cfg)
    assert got == limit and why in reason
    path = write_config(tmp_path, cfg)
    assert ModelConfig.from_pretrained(path).context_len == min(limit, cfg["max_position_embeddings"])
    assert ModelConfig.from_pretrained(path, context_length=limit).context_len == limit
    with pytest.raises(ValueError, match=rf"context_length {limit + 1} exceeds .*: {limit} tokens \(.*{why}"):
        ModelConfig.from_pretrained(path, context_length=limit + 1)


def test_rope_types_still_unsupported_raise(tmp_path: Path) -> None:
    for rope_type in ("dynamic", "mrope"):
        cfg = {**BASE, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}}
        with pytest.raises(ValueError, match=f"unsupported rope_type '{rope_type}'.*'yarn'"):
            ModelConfig.from_pretrained(write_config(tmp_path, cfg))


def _legacy_spelling(path: Path) -> None:
    """Rewrite config.json as transformers 4.x saved yarn: top-level rope_theta, rope_scaling, `type`."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (path / "config.json").write_text(json.dumps(cfg))


# name -> (arch, config overrides, expected attention factor); original length 16, so
# every prompt below runs mostly past it. The llama one is saved in the older spelling.
VARIANTS: dict[str, tuple[str, dict[str, Any], float]] = {
    "qwen3-yarn": ("qwen3", {"max_position_embeddings": 64, "initializer_range": 0.2, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}},
        0.1 * math.log(4.0) + 1),
    "llama-yarn-mscale-legacy": ("llama", {"max_position_embeddings": 128, "initializer_range": 0.2, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8, "truncate": False}},
        (0.1 * math.log(8.0) + 1) / (0.05 * math.log(8.0) + 1)),
}
LENS = (40, 23, 1, 33)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> tuple[ModelRunner, torch.nn.Module, Path]:
    """(sprig runner, HF model, checkpoint), both float32 on CPU."""
    arch, overrides, attention_factor = VARIANTS[request.param]
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("yarn") / request.param, arch, seed=4, **overrides)
    if "legacy" in request.param:
        _legacy_spelling(path)
    runner = ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=512))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.rope_type == "yarn"  # both sides really run yarn
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(attention_factor)
    assert runner.model_config.rope_scaling["rope_type"] == "yarn"
    return runner, hf, path


def test_prefill_logits_match_transformers_past_the_original_length(pair) -> None:
    runner, hf, path = pair
    batch = prompts(runner.model_config.vocab_size, lens=LENS, seed=5)
    slots = ArangeSlots(runner)
    step = contexts_step(ForwardMode.EXTEND, [t for p in batch for t in p], list(LENS),
                         [slots.take(n) for n in LENS], [0] * len(batch))
    logits = runner.forward(step)
    for got, ids in zip(logits.split(LENS), batch, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)
    # the setting tells yarn apart: the same weights with plain RoPE are far off
    plain = AutoConfig.from_pretrained(path)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": plain.rope_parameters["rope_theta"]}
    other = AutoModelForCausalLM.from_pretrained(path, config=plain, dtype=torch.float32).eval()
    assert (hf_logits(other, batch[0]) - logits[: LENS[0]]).abs().max() > 100 * ATOL


def test_greedy_decode_matches_transformers_generate(pair) -> None:
    runner, hf, _ = pair
    batch = prompts(runner.model_config.vocab_size, lens=(30, 17), seed=6)
    slots = ArangeSlots(runner)
    contexts = [slots.take(len(p)) for p in batch]
    step = contexts_step(ForwardMode.EXTEND, [t for p in batch for t in p], [len(p) for p in batch], contexts,
                         [len(p) - 1 for p in batch])
    outputs: list[list[int]] = [[] for _ in batch]
    for i in range(10):
        next_ids = runner.forward(step).argmax(-1).tolist()
        for out, tok in zip(outputs, next_ids, strict=True):
            out.append(tok)
        if i == 9:
            break
        contexts = [torch.cat([c, slots.take(1)]) for c in contexts]
        step = contexts_step(ForwardMode.DECODE, next_ids, [1] * len(batch), contexts, [0] * len(batch))
    for ids, got in zip(batch, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                              pad_token_id=hf.config.eos_token_id)[0, len(ids):].tolist()
        assert got[: len(ref)] == ref


def test_the_engine_serves_the_stretched_context_like_transformers(tmp_path: Path) -> None:
    """Qwen2.5 style: max_position_embeddings is the original 32, yarn x4 stretches it to
    128; the engine asked for 128 tokens serves positions past 32 as transformers does."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    path = build_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=7, max_position_embeddings=32,
                                 initializer_range=0.2, rope_parameters=rope)
    ids = prompts(512, lens=(100,), seed=8)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                          pad_token_id=hf.config.eos_token_id)[0, len(ids):].tolist()
    with Engine(path, dtype="float32", context_length=128) as engine:
        assert engine.scheduler.context_len == 128
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 20, "temperature": 0})
    assert out["output_ids"][: len(ref)] == ref and len(ref) > 0
    with pytest.raises(ValueError, match="longest context this model supports: 128 tokens"):
        Engine(path, dtype="float32", context_length=129)
