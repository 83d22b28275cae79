"""The model runner against Hugging Face transformers on the same tiny checkpoints (dense,
mixture-of-experts, sliding-window, post-norm, NoPE, fused-checkpoint Phi-3): prefill logits,
greedy decoding, chunked prefill, bfloat16 (DESIGN.md §5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import contexts_step
from transformers import AutoModelForCausalLM

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    PHI3_ARCHITECTURES,
    build_tiny_checkpoint,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (arch, config overrides); a larger initializer_range makes attention sharp
# enough that a wrong RoPE or head mapping moves the logits far past the tolerance
VARIANTS = {
    "llama-mqa": ("llama", {"num_key_value_heads": 1, "initializer_range": 0.2}),
    "qwen2-mha": ("qwen2", {"num_key_value_heads": 4, "initializer_range": 0.2}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True, "initializer_range": 0.2}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE, "initializer_range": 0.2}),
    "mistral-rope-linear": (
        "mistral",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "initializer_range": 0.2},
    ),
    # a dense first layer (mlp_only_layers), renormalized top-3 of 4, a tied head
    "qwen3_moe-dense0-top3": ("qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": True, "num_experts_per_tok": 3,
                                           "tie_word_embeddings": True, "initializer_range": 0.2}),
    # sparse only every second layer (decoder_sparse_step), 8 experts with a shared one
    "qwen2_moe-step2-8experts": ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3, "num_experts": 8,
                                              "initializer_range": 0.2}),
    # sliding windows shorter than the prompts: in every layer (Mistral v0.1), in the layers
    # from max_window_layers on (Qwen2), and Gemma 3's with its own RoPE per layer kind, a
    # linearly scaled full RoPE and soft-capped logits
    "mistral-window5": ("mistral", {"sliding_window": 5, "initializer_range": 0.2}),
    "qwen2-window3-from-layer1": ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1,
                                           "initializer_range": 0.2}),
    "gemma3-window4-softcap": ("gemma3", {
        "sliding_window": 4, "num_hidden_layers": 3, "final_logit_softcapping": 3.0, "initializer_range": 0.2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 777.0}}}),
    # OLMo 3: windows of 3 in three layers of four, yarn on the full layer's RoPE only
    "olmo3-window3-yarn": ("olmo3", {
        "sliding_window": 3, "num_hidden_layers": 4, "layer_types": None, "initializer_range": 0.2,
        "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10_000.0,
                                               "original_max_position_embeddings": 8},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # SmolLM3: its NoPE layer (the fourth) attends within a window of 4
    "smollm3-nope-window4": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "use_sliding_window": True,
                                         "sliding_window": 4, "initializer_range": 0.2}),
    # Phi-3-mini-4k's window in every layer (tests/runtime/test_phi3.py: sharp partial longrope)
    "phi3-window5": ("phi3", {"sliding_window": 5, "initializer_range": 0.2}),
}
PROMPT_LENS = (7, 1, 12, 4)
ATOL = 1e-4


class ArangeSlots:
    """Trivial slot allocation: consecutive slots from the first usable one."""

    def __init__(self, runner: ModelRunner) -> None:
        self.next = runner.kv_cache.page_size

    def take(self, n: int) -> torch.Tensor:  # [n] int32
        slots = torch.arange(self.next, self.next + n, dtype=torch.int32)
        self.next += n
        return slots


@pytest.fixture(scope="module")
def variant_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {
        name: build_tiny_checkpoint(root / name, arch, seed=1, **overrides)
        for name, (arch, overrides) in VARIANTS.items()
    }


@pytest.fixture(scope="module", params=[*ARCHITECTURES, *MOE_ARCHITECTURES, *PHI3_ARCHITECTURES, *VARIANTS])
def pair(request, tiny_checkpoints, variant_checkpoints) -> tuple[ModelRunner, torch.nn.Module]:
    """(sprig runner, HF model), both float32 on CPU, for one checkpoint."""
    path = {**tiny_checkpoints, **variant_checkpoints}[request.param]
    runner = ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", max_total_tokens=512))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, hf


def prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lens]


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:  # [len, V]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_batch_matches_hf(pair) -> None:
    runner, hf = pair
    batch = prompts(runner.model_config.vocab_size)
    slots = ArangeSlots(runner)
    step = contexts_step(
        ForwardMode.EXTEND,
        [t for p in batch for t in p],
        [len(p) for p in batch],
        [slots.take(len(p)) for p in batch],
        [0] * len(batch),
    )
    logits = runner.forward(step)
    assert logits.dtype == torch.float32 and logits.shape == (
        sum(PROMPT_LENS),
        hf.config.vocab_size,
    )
    for got, ids in zip(logits.split(PROMPT_LENS), batch, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_long_windowed_prompts_match_hf(pair) -> None:
    """Prompts far longer than the windows: the CPU backend takes their windowed queries in
    blocks, each over the slots its window reaches (`banded_attention_ref`)."""
    runner, hf = pair
    if getattr(hf.config, "sliding_window", None) is None:
        pytest.skip("no sliding window")
    lens = (150, 70)
    batch = prompts(runner.model_config.vocab_size, lens=lens, seed=4)
    slots = ArangeSlots(runner)
    step = contexts_step(ForwardMode.EXTEND, [t for p in batch for t in p], list(lens),
                         [slots.take(n) for n in lens], [0] * len(lens))
    for got, ids in zip(runner.forward(step).split(lens), batch, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_greedy_decode_matches_hf_generate(pair) -> None:
    runner, hf = pair
    batch = prompts(runner.model_config.vocab_size, seed=1)
    steps = 8
    slots = ArangeSlots(runner)
    contexts = [slots.take(len(p)) for p in batch]
    step = contexts_step(
        ForwardMode.EXTEND,
        [t for p in batch for t in p],
        [len(p) for p in batch],
        contexts,
        [len(p) - 1 for p in batch],
    )
    outputs: list[list[int]] = [[] for _ in batch]
    for i in range(steps):
        next_ids = runner.forward(step).argmax(-1).tolist()
        for out, tok in zip(outputs, next_ids, strict=True):
            out.append(tok)
        if i == steps - 1:
            break
        contexts = [torch.cat([c, slots.take(1)]) for c in contexts]
        step = contexts_step(ForwardMode.DECODE, next_ids, [1] * len(batch), contexts, [0] * len(batch))
    for ids, got in zip(batch, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=steps,
                do_sample=False,
                pad_token_id=hf.config.eos_token_id,
            )[0, len(ids) :].tolist()
        assert got[: len(ref)] == ref  # HF stops early only at an eos


def test_chunked_prefill_matches_single_extend(pair) -> None:
    """Prefix then the rest as an extend over the cached prefix, batched with a fresh
    prompt, gives the logits of one extend (and of HF)."""
    runner, hf = pair
    long, other = prompts(runner.model_config.vocab_size, lens=(13, 6), seed=2)
    cut = 5
    slots = ArangeSlots(runner)
    whole = runner.forward(contexts_step(ForwardMode.EXTEND, long, [13], [slots.take(13)], [0]))

    ctx, ctx_other = slots.take(cut), slots.take(6)
    first = runner.forward(contexts_step(ForwardMode.EXTEND, long[:cut], [cut], [ctx], [0]))
    ctx = torch.cat([ctx, slots.take(13 - cut)])
    rest = runner.forward(
        contexts_step(ForwardMode.EXTEND, long[cut:] + other, [13 - cut, 6], [ctx, ctx_other], [0, 0])
    )
    chunked = torch.cat([first, rest[: 13 - cut]])
    # 5e-5: with two torch threads the matmuls of 13 rows and of 5 + 14 rows split their
    # sums differently (2.1e-5 apart on smollm3's NoPE layer); with one, as CI runs, exactly
    torch.testing.assert_close(chunked, whole, atol=5e-5, rtol=0)
    torch.testing.assert_close(chunked, hf_logits(hf, long), atol=ATOL, rtol=0)
    torch.testing.assert_close(rest[13 - cut :], hf_logits(hf, other), atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("bf16") / "qwen3", "qwen3", dtype="bfloat16", initializer_range=0.2
    )


@pytest.mark.parametrize("source", ["bf16-checkpoint-auto", "f32-checkpoint-as-bf16"])
def test_bfloat16_runs_close_to_hf(source: str, bf16_checkpoint: Path, tiny_llama: Path) -> None:
    path, dtype = (
        (bf16_checkpoint, "auto") if source == "bf16-checkpoint-auto" else (tiny_llama, "bfloat16")
    )
    runner = ModelRunner(RunnerConfig(path, dtype=dtype, device="cpu", max_total_tokens=64))
    assert runner.dtype == torch.bfloat16
    assert runner.kv_cache.k[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    ids = prompts(runner.model_config.vocab_size, lens=(9,), seed=3)[0]
    logits = runner.forward(
        contexts_step(ForwardMode.EXTEND, ids, [9], [ArangeSlots(runner).take(9)], [0])
    )
    assert logits.dtype == torch.float32
    ref = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ids)
    hf_bf16 = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)
    hf_error = (hf_bf16 - ref).abs().max()
    assert (logits - ref).abs().max() <= 2 * hf_error + 1e-3  # no worse than HF's own bf16
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
