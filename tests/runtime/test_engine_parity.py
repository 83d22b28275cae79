"""Greedy output equals transformers token for token: batched, cold and warm cache,
chunked prefill, paged KV, and under retraction. Logprobs equal its log-softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle_and_intact, hf_greedy, hf_logprobs, make_prompts

from sprig.runtime import Engine

MAX_NEW = 8
PROMPTS = make_prompts(16)
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "olmo3", "smollm3", "granite", "mixtral",
         "qwen2_moe", "qwen3_moe", "gpt_oss", "phi3", "phi4_mini"]


@pytest.fixture(scope="module")
def references(tiny_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(tiny_checkpoints[arch], PROMPTS, MAX_NEW) for arch in ARCHS}


def run(engine: Engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, GREEDY)
    assert_idle_and_intact(engine)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_transformers_cold_and_warm(arch, tiny_checkpoints, references) -> None:
    with Engine(tiny_checkpoints[arch], dtype="float32", check_integrity=True) as engine:
        assert run(engine) == references[arch]
        warm = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in warm] == references[arch]
        assert sum(o["meta_info"]["cached_tokens"] for o in warm) > 0
        assert_idle_and_intact(engine)


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 5},
        {"page_size": 16, "max_total_tokens": 4096},
        {"schedule_policy": "lpm"},
        {"schedule_policy": "dfs-weight", "page_size": 4, "chunked_prefill_size": 7},
        {"disable_radix_cache": True},
    ],
    ids=["chunked-5", "page-16", "lpm", "dfs-page4-chunked7", "no-cache"],
)
def test_greedy_equals_transformers_under_scheduler_options(options, tiny_checkpoints, references) -> None:
    with Engine(tiny_checkpoints["llama"], dtype="float32", check_integrity=True, **options) as engine:
        assert run(engine) == references["llama"]
        assert run(engine) == references["llama"]


def test_greedy_equals_transformers_with_retraction(tiny_checkpoints, references) -> None:
    options = {"max_total_tokens": 96, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0}
    with Engine(tiny_checkpoints["qwen2"], dtype="float32", check_integrity=True, **options) as engine:
        assert run(engine) == references["qwen2"]
        assert engine.scheduler.stats.retractions > 0


def test_chunked_prefill_is_cached_chunk_by_chunk(tiny_llama) -> None:
    prompt = make_prompts(1, seed=7)[0] * 3
    with Engine(tiny_llama, dtype="float32", chunked_prefill_size=4, check_integrity=True) as engine:
        first = engine.generate(prompt, GREEDY)
        second = engine.generate(prompt, GREEDY)
        assert second["output_ids"] == first["output_ids"]
        assert second["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
        assert engine.scheduler.stats.prefill_tokens == first["meta_info"]["prompt_tokens"] + 1
        assert_idle_and_intact(engine)


PICKED = [9, 2, 300, 41]  # token_ids_logprob: any ids, in any order


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_equal_transformers_log_softmax(arch, tiny_checkpoints) -> None:
    path = tiny_checkpoints[arch]
    with Engine(path, dtype="float32") as engine:
        engine.generate(PROMPTS[0], GREEDY)  # warm the cache: input logprobs must still be computed
        out = engine.generate(
            PROMPTS[0], GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
            token_ids_logprob=PICKED,
        )
        assert_idle_and_intact(engine)
    meta = out["meta_info"]
    prompt_ids = [e[1] for e in meta["input_token_logprobs"]]
    full = prompt_ids + out["output_ids"]
    ref = hf_logprobs(path, full)
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for pos, (lp, tok, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert tok == full[pos]
        assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        pos = len(prompt_ids) + i
        assert lp == pytest.approx(ref[pos - 1, tok].item(), abs=1e-4)
        top = meta["output_top_logprobs"][i]
        ref_top = ref[pos - 1].topk(3)
        assert [t[1] for t in top] == ref_top.indices.tolist()
        assert [t[0] for t in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)
    assert meta["input_token_ids_logprobs"][0] is None
    picked = meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]
    assert len(picked) == len(full) - 1
    for pos, row in enumerate(picked):  # the prediction after token pos, in PICKED's order
        assert [t for _, t, _ in row] == PICKED
        assert [lp for lp, _, _ in row] == pytest.approx(ref[pos, PICKED].tolist(), abs=1e-4)


def test_logprob_start_len_limits_input_logprobs(tiny_llama) -> None:
    with Engine(tiny_llama, dtype="float32") as engine:
        ids = engine.tokenizer.encode(PROMPTS[3])
        out = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3
        )
        assert_idle_and_intact(engine)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[3:]
    ref = hf_logprobs(tiny_llama, ids)
    for k, (lp, tok, _) in enumerate(entries):
        assert lp == pytest.approx(ref[3 + k - 1, tok].item(), abs=1e-4)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_greedy_equals_transformers_with_triton_attention(tiny_llama) -> None:
    """The Triton backend (in the interpreter on CPU) through the whole engine."""
    prompts = PROMPTS[:3]
    expected = hf_greedy(tiny_llama, prompts, 4)
    options = {"attention_backend": "triton", "chunked_prefill_size": 6, "check_integrity": True}
    with Engine(tiny_llama, dtype="float32", **options) as engine:
        for _ in range(2):  # cold, then warm cache
            outs = engine.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
            assert [o["output_ids"] for o in outs] == expected
        assert_idle_and_intact(engine)
