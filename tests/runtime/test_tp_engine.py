"""Tensor parallelism through the offline Engine: TP=2 and TP=4 over gloo on the CPU give
the greedy tokens of TP=1 on every architecture (dense and mixture-of-experts), prompt and output logprobs within 1e-4,
through chunked prefill, radix reuse and sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle_and_intact, make_prompts
from gpt_oss_checkpoints import biased_copy, mxfp4_pair

from sprig.runtime import Engine
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=2048, chunked_prefill_size=16)
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}
SAMPLED = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}
# (checkpoint, tp_size); the tiny models have 4 q heads and 2 KV heads, so at TP=4 each KV
# head is replicated on two ranks; "gqa1" has one KV head, a tied head and a vocabulary of
# 301 (an uneven split of the vocabulary). TP=4 (three more processes, about 20 s a case on
# two cores) runs on Qwen2: Llama's and Mistral's wiring with q/k/v biases, a replicated KV
# head's biases on both its ranks. (Qwen3's q/k norms are per head, over head_dim, the same
# on a replicated KV head as on a split one: Qwen3 runs at TP=2.) Of the mixture-of-experts
# models, Mixtral (its block named `block_sparse_moe`) and Qwen2-MoE (a shared expert beside
# the experts) run at TP=2, as does Gemma 3 (sandwich norms, a scaled embedding, a tied
# head, a sliding window) and "phi_window", a Phi-4-mini (fused q/k/v and gate/up checkpoint
# tensors, partial longrope, a tied head) with Phi-3-mini-4k's window in every layer. OLMo 3
# (q and k norms over all heads, summed over the ranks; a window of 8 in its first layer, a
# full second) runs at TP=2, and as "olmo3_gqa1" with one KV head, replicated on both ranks
# (its k norm must count it once), and yarn on the full layer's RoPE. gpt-oss (biased
# q/k/v/o, a sink per q head, a window of 8 in every other layer, YaRN; experts with
# interleaved gate/up and biases; sharp weights, every bias drawn anew) runs at TP=2 in
# float and as "gpt_oss_mxfp4" (each rank one block of 32 of its experts' 64 features).
CASES = [(arch, 2) for arch in ("llama", "mistral", "qwen2", "qwen3", "gqa1", "mixtral", "qwen2_moe", "gemma3",
                                "phi_window", "olmo3", "olmo3_gqa1", "gpt_oss", "gpt_oss_mxfp4")] + [("qwen2", 4)]
INT8_KV = {"kv_cache_dtype": "int8"}  # one scale per token and KV head: each rank scales its own heads


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gqa1 = build_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "gqa1", "llama", num_key_value_heads=1,
                                 tie_word_embeddings=True, vocab_size=301)
    phi_window = build_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "phi_window", "phi4_mini", sliding_window=8)
    yarn = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10_000.0,
                               "original_max_position_embeddings": 8},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    olmo3_gqa1 = build_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "olmo3_gqa1", "olmo3", num_key_value_heads=1,
                                       rope_parameters=yarn)
    sharp = build_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "gpt_oss", "gpt_oss", initializer_range=0.2)
    gpt_oss = biased_copy(sharp, tmp_path_factory.mktemp("tp") / "gpt_oss", seed=1)
    gpt_oss_mxfp4 = mxfp4_pair(gpt_oss, tmp_path_factory.mktemp("tp"))[0]
    return {**tiny_checkpoints, "gqa1": gqa1, "phi_window": phi_window, "olmo3_gqa1": olmo3_gqa1,
            "gpt_oss": gpt_oss, "gpt_oss_mxfp4": gpt_oss_mxfp4}


def run(engine: Engine) -> list[dict]:
    """Greedy with prompt logprobs, the same prompts again (radix hits), and seeded samples."""
    prompts = make_prompts(6, seed=3)
    prompts += [prompts[0] + " and then the fox ran", prompts[1] + " one two three"]  # shared prefixes
    outs = []
    for _ in range(2):
        outs += engine.generate(prompts, GREEDY, return_logprob=True, logprob_start_len=0)
    outs += engine.generate(prompts[:3], SAMPLED)
    assert_idle_and_intact(engine)
    return outs


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[dict]]:
    """TP=1 outputs per checkpoint, computed on first use."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            with Engine(str(checkpoints[name]), **ENGINE) as engine:
                cache[name] = run(engine)
        return cache[name]

    return get


def logprobs(out: dict, key: str) -> list[float]:
    return [entry[0] for entry in out["meta_info"][key] if entry[0] is not None]


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_tp_matches_tp1(name: str, tp: int, checkpoints: dict[str, Path], references) -> None:
    expected = references(name)
    with Engine(str(checkpoints[name]), tp_size=tp, **ENGINE) as engine:
        kv_heads = 1 if name == "gqa1" else max(2 // tp, 1)  # this rank's share of the KV heads
        assert engine.runner.kv_cache.shape.num_kv_heads == kv_heads
        got = run(engine)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert sum(o["meta_info"]["cached_tokens"] for o in got) > 0  # the second pass reused prefixes
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in b["meta_info"]:
                la, lb = logprobs(a, key), logprobs(b, key)
                assert len(la) == len(lb)
                worst = max([worst, *(abs(x - y) for x, y in zip(la, lb, strict=True))])
    assert worst < 1e-4, worst


def test_tp_with_an_int8_kv_cache_matches_tp1(checkpoints: dict[str, Path]) -> None:
    path = str(checkpoints["qwen2"])
    with Engine(path, **ENGINE, **INT8_KV) as engine:
        expected = run(engine)
    with Engine(path, tp_size=2, **ENGINE, **INT8_KV) as engine:
        got = run(engine)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]


def test_tp_with_speculative_decoding_matches_tp1(checkpoints: dict[str, Path]) -> None:
    """Drafts are verified in one extend, which every rank runs like any other step."""
    prompts = [[1, 5, 9, 33, 2] * 3, [7, 8, 9, 10, 11] * 3]  # repeats: n-gram drafts to verify
    params = {"max_new_tokens": 24, "temperature": 0.0}
    with Engine(str(checkpoints["llama"]), **ENGINE) as engine:
        expected = engine.generate(input_ids=prompts, sampling_params=params)
    # pass costs given, not timed: on a busy CPU the timed ones can rule drafting out
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4, "speculative_pass_costs": "1,0,0,0,0,0,0"}
    with Engine(str(checkpoints["llama"]), tp_size=2, **ENGINE, **spec) as engine:
        got = engine.generate(input_ids=prompts, sampling_params=params)
        assert_idle_and_intact(engine)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert all(o["meta_info"]["spec_verify_ct"] < len(o["output_ids"]) for o in got)  # drafts were accepted
