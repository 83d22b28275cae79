"""The draft model's contiguous decode rounds (`DraftDecoder`) against the runner's general
path, on every architecture, with a float and an int8 KV pool: the same proposals, logits
equal up to rounding at every step (shadow mode), and the same K/V left in the pool. The
plain rounds (`RunnerRounds`, the runner's decode steps) against the same reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.speculative.draft_decoder import DraftDecoder, supports
from sprig.runtime.speculative.runner_rounds import RunnerRounds
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

CONTEXTS = [7, 12, 1, 30]  # prompt tokens in the pool per request
DRAFTS = [4, 2, 3, 1]
FED = [[5], [9, 10, 11], [17], [33, 34]]  # tokens fed before the drafts (a request catching up on several)


def runner(path: Path, kv_cache_dtype: str = "auto", **options) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=512,
                                    kv_cache_dtype=kv_cache_dtype, attention_backend="reference", **options))


def prefill(r: ModelRunner) -> list[torch.Tensor]:
    """Each request's prompt (CONTEXTS[b] tokens) in the pool; its slots, with room for its steps."""
    slots, first = [], r.kv_cache.page_size
    gen = torch.Generator().manual_seed(0)
    for n, k in zip(CONTEXTS, (len(t) + d for t, d in zip(FED, DRAFTS, strict=True)), strict=True):
        s = torch.arange(first, first + n + k)
        first += n + k
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()
        r.forward(ForwardStep(ForwardMode.EXTEND, ids, [n], [n], s[:n], [n - 1]))
        slots.append(s)
    return slots


def general_round(r: ModelRunner, slots: list[torch.Tensor]) -> list[list[int]]:
    """The same round one general decode step at a time: FED[b], then each argmax, until
    DRAFTS[b] argmax tokens follow the last of FED[b]."""
    steps = [len(t) - 1 + n for t, n in zip(FED, DRAFTS, strict=True)]
    out: list[list[int]] = [[] for _ in slots]
    fed = [t[0] for t in FED]
    for j in range(max(steps)):
        live = [b for b in range(len(slots)) if steps[b] > j]
        ends = [CONTEXTS[b] + j + 1 for b in live]
        step = ForwardStep(ForwardMode.DECODE, [fed[b] for b in live], [1] * len(live), ends,
                           torch.cat([slots[b][:e] for b, e in zip(live, ends, strict=True)]), [0] * len(live))
        for b, token in zip(live, r.forward(step).argmax(dim=-1).tolist(), strict=True):
            if j + 1 < len(FED[b]):
                fed[b] = FED[b][j + 1]
            else:
                out[b].append(token)
                fed[b] = token
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_round_equals_the_general_path(arch: str, kv_cache_dtype: str, tiny_checkpoints: dict[str, Path]) -> None:
    general, lean = runner(tiny_checkpoints[arch], kv_cache_dtype), runner(tiny_checkpoints[arch], kv_cache_dtype)
    slots = prefill(general)
    assert [torch.equal(a, b) for a, b in zip(slots, prefill(lean), strict=True)] == [True] * len(slots)
    want = general_round(general, slots)
    got = DraftDecoder(lean, shadow=True).run(slots, CONTEXTS, FED, DRAFTS)
    assert got == want and [len(d) for d in got] == DRAFTS
    written = torch.cat([s[n : n + len(t) - 1 + d] for s, n, t, d in zip(slots, CONTEXTS, FED, DRAFTS, strict=True)])
    for a, b in zip(general.kv_cache.k + general.kv_cache.v, lean.kv_cache.k + lean.kv_cache.v, strict=True):
        torch.testing.assert_close(b[written].float(), a[written].float(), atol=1e-5 if kv_cache_dtype == "auto" else 1,
                                   rtol=1e-4 if kv_cache_dtype == "auto" else 0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_runner_rounds_equal_the_general_path(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Requests feeding one to three tokens before their drafts, in one round of steps."""
    general, plain = runner(tiny_checkpoints[arch]), runner(tiny_checkpoints[arch])
    slots = prefill(general)
    prefill(plain)
    assert RunnerRounds(plain).run(slots, CONTEXTS, FED, DRAFTS) == general_round(general, slots)
    for a, b in zip(general.kv_cache.k + general.kv_cache.v, plain.kv_cache.k + plain.kv_cache.v, strict=True):
        assert torch.equal(a, b)


def test_shadow_mode_catches_a_wrong_step(tiny_llama: Path) -> None:
    """A decoder whose layers read a wrong weight is caught at its first step."""
    r = runner(tiny_llama)
    slots = prefill(r)
    decoder = DraftDecoder(r, shadow=True)
    layer = decoder.layers[0]
    decoder.layers[0] = type(layer)(**{**layer.__dict__, "post_norm": layer.post_norm * 1.5})
    with pytest.raises(AssertionError, match="step 0's logits differ"):
        decoder.run(slots, CONTEXTS, FED, DRAFTS)


def test_only_unquantized_cpu_models_are_taken(tiny_llama: Path) -> None:
    assert supports(runner(tiny_llama))
    quantized = runner(tiny_llama, quantization="int8")
    assert not supports(quantized)
    with pytest.raises(ValueError, match="unquantized"):
        DraftDecoder(quantized)


@pytest.mark.parametrize("arch", ["gemma3", "olmo3", "smollm3"])
def test_models_with_windows_nope_or_other_blocks_are_not_taken(arch: str, tiny_checkpoints: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    """Its layers compute full attention with RoPE and SwiGLU only: a sliding window, a NoPE
    layer or another block (Gemma's, OLMo's) runs through the runner instead."""
    assert not supports(runner(tiny_checkpoints[arch]))
    windowed = build_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    assert not supports(runner(windowed))
