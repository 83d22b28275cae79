"""The engine's differential fuzzer (engine_fuzz.py) with CI's bounded budget; a longer
run: `python -m pytest tests/runtime/test_engine_fuzz.py --fuzz-minutes 30 -s`. A
failure names the workload seed: `--fuzz-seed S` replays it first. The engines run on the
CPU unless `--fuzz-device cuda` (transformers, the reference, always does)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_fuzz import Workload, fuzz, make_workload, reference_key
from gpt_oss_checkpoints import mxfp4_pair
from vision_checkpoint import build_vision_checkpoint

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

CI_SECONDS = 32
INT4_CI_SECONDS = 12
TP_CI_SECONDS = 12


@pytest.fixture(scope="module")
def models(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny llama and qwen3, two with larger weights (sharp attention and logits, so
    that a request reading another's rows shows): MQA llama and GQA mistral, and two
    mixture-of-experts models (`engine_fuzz.MOE_SHARE` of workloads): Qwen2-MoE with its
    shared expert, and a sharp Qwen3-MoE whose router spreads tokens over 8 experts, and
    gpt-oss (`engine_fuzz.SINK_SHARE` of those; MXFP4 experts, attention sinks, windows of 5
    in two of its three layers); two
    with sliding windows shorter than most prompts (`engine_fuzz.WINDOW_SHARE`): Gemma 3
    (a window of 6 in two of its three layers), Gemma 2 (7 in its first layer; attention
    scores and logits soft-capped), Qwen2 (12, in its second layer) and OLMo 3 (5, in three
    of its four layers; norms after attention and the MLP); a Gemma 3 vision-language model
    (`engine_fuzz.VISION_SHARE`; images of 4 tokens, windows of 5); and a sharp Phi-4-mini
    (`engine_fuzz.FUSED_SHARE`: fused projections, longrope, a quarter of each head
    unrotated, tied embeddings)."""
    root = tmp_path_factory.mktemp("fuzz")
    return {
        "llama": tiny_checkpoints["llama"],
        "qwen3": tiny_checkpoints["qwen3"],
        "llama-mqa-sharp": build_tiny_checkpoint(
            root / "mqa", "llama", seed=3, num_key_value_heads=1, initializer_range=0.15
        ),
        "mistral-sharp": build_tiny_checkpoint(root / "mistral", "mistral", seed=4, initializer_range=0.1),
        "phi4_mini-sharp": build_tiny_checkpoint(root / "phi4_mini", "phi4_mini", seed=12, initializer_range=0.1),
        "qwen2_moe": tiny_checkpoints["qwen2_moe"],
        "qwen3_moe-sharp": build_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=5, num_experts=8,
                                                 initializer_range=0.1),
        "gemma3-sharp": build_tiny_checkpoint(root / "gemma3", "gemma3", seed=6, sliding_window=6,
                                              num_hidden_layers=3, initializer_range=0.1),
        "qwen2-window-sharp": build_tiny_checkpoint(root / "qwen2w", "qwen2", seed=7, use_sliding_window=True,
                                                    sliding_window=12, max_window_layers=1, initializer_range=0.1),
        "olmo3-sharp": build_tiny_checkpoint(root / "olmo3", "olmo3", seed=8, sliding_window=5, num_hidden_layers=4,
                                             layer_types=None, initializer_range=0.1),
        "gemma2-sharp": build_tiny_checkpoint(root / "gemma2", "gemma2", seed=9, sliding_window=7, initializer_range=0.1),
        "gemma3-vision": build_vision_checkpoint(root / "gemma3-vision", sliding_window=5, seed=10),
        "gpt_oss-mxfp4": mxfp4_pair(build_tiny_checkpoint(root / "gpt_oss-float", "gpt_oss", seed=11, sliding_window=5,
                                                          num_hidden_layers=3, initializer_range=0.1), root / "gpt_oss")[0],
    }


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fuzz-device")


@pytest.mark.fuzz
def test_every_request_equals_itself_alone(models: dict[str, Path], device: str, request: pytest.FixtureRequest) -> None:
    minutes = request.config.getoption("--fuzz-minutes")
    seed = request.config.getoption("--fuzz-seed")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def progress(line: str) -> None:
        if reporter is not None and minutes:
            reporter.write_line(line)
            reporter.flush()

    stats = fuzz(models, seconds=minutes * 60 if minutes else CI_SECONDS, seed=seed, min_workloads=10, progress=progress,
                 device=device)
    print(stats.line())
    assert stats.requests > 0 and stats.tokens > 0 and stats.constrained > stats.context_free > 0 and stats.guided > 0
    assert stats.embeddings > 0
    assert stats.by_backend.get("torch", 0) > 0
    assert stats.by_model.keys() & {"qwen2_moe", "qwen3_moe-sharp"}  # CI's first workloads include one
    assert stats.by_model.keys() & {"gemma2-sharp", "gemma3-sharp", "qwen2-window-sharp", "olmo3-sharp"}  # and a sliding-window one
    assert stats.lora > 0


def test_workloads_are_a_function_of_their_seed() -> None:
    one: Workload = make_workload(7, "m", 512, triton=False)
    assert make_workload(7, "m", 512, triton=False) == one
    assert make_workload(8, "m", 512, triton=False) != one


def test_workloads_draw_embedding_requests() -> None:
    embeds = [sum(r.embed for r in make_workload(seed, "m", 512, triton=False).requests) for seed in range(8)]
    assert sum(embeds) >= 2  # CI's first workloads include some
    assert all(r.checked for seed in range(30) for r in make_workload(seed, "m", 512, triton=False).requests if r.embed)


def test_workloads_run_on_float_and_int8_kv_caches() -> None:
    kinds = [make_workload(seed, "m", 512, triton=False).options["kv_cache_dtype"] for seed in range(30)]
    assert {"auto", "int8"} == set(kinds) and kinds[:4].count("int8") >= 1  # CI's first workloads include int8


def test_workloads_draw_int4_weights() -> None:
    options = [make_workload(seed, "m", 512, triton=False).options for seed in range(40)]
    kinds = {(o.get("quantization"), o.get("quantization_group_size")) for o in options}
    assert kinds == {(None, None), ("int4", 32), ("int4", 64)}
    kv = [make_workload(seed, "m", 512, triton=False, int4_share=0.0).options["kv_cache_dtype"] for seed in range(40)]
    assert kv == [o["kv_cache_dtype"] for o in options]  # the share changes nothing else


def test_workloads_draw_stale_starts() -> None:
    stale = [make_workload(seed, "m", 512, triton=False).stale_start for seed in range(40)]
    assert any(stale[:8]) and 2 <= sum(stale) <= 12  # CI's first workloads include one


def test_workloads_draw_priority_scheduling() -> None:
    workloads = [make_workload(seed, "m", 512, triton=False) for seed in range(40)]
    by_priority = [w for w in workloads if w.options.get("enable_priority_scheduling")]
    assert any(w.seed < 8 for w in by_priority) and 4 <= len(by_priority) <= 20  # CI's first workloads include one
    assert all(r.priority is None for w in workloads if w not in by_priority for r in w.requests)
    assert {r.priority for w in by_priority for r in w.requests} >= {None, 0, 20, -3}


def test_workloads_draw_lora_adapters() -> None:
    workloads = [make_workload(seed, "m", 512, triton=False) for seed in range(60)]
    served = [w for w in workloads if "max_loras_per_batch" in w.options]
    assert any(w.seed < 10 for w in served) and 3 <= len(served) <= 20  # CI's first workloads include one
    assert all("quantization" not in w.options and "tp_size" not in w.options for w in served)
    assert {r.lora for w in served for r in w.requests} == {None, "a", "b"}
    assert all(r.lora is None for w in workloads if w not in served for r in w.requests)


def test_workloads_draw_speculative_decoding() -> None:
    drafters = [make_workload(seed, "m", 512, triton=False).options.get("speculative_algorithm") for seed in range(40)]
    assert set(drafters) == {None, "ngram", "radix", "draft"}


def test_workloads_draw_llguidance_as_the_grammar_backend_and_their_references_follow() -> None:
    workloads = [make_workload(seed, "m", 512, triton=False) for seed in range(40)]
    guided = [w for w in workloads if w.options.get("grammar_backend") == "llguidance"]
    assert 0 < len(guided) < len(workloads) and all(w.options.get("grammar_backend") in (None, "llguidance")
                                                    for w in workloads)
    assert all(("grammar_backend", "llguidance") in reference_key(w.options) for w in guided)
    assert all(k != "grammar_backend" for w in workloads if w not in guided for k, _ in reference_key(w.options))


@pytest.mark.fuzz
def test_int4_weights_every_request_equals_itself_alone(models: dict[str, Path], device: str,
                                                       request: pytest.FixtureRequest) -> None:
    """Every workload with int4 weights (RTN, groups of 32 or 64), beside any KV cache."""
    seed = request.config.getoption("--fuzz-seed")
    chosen = {name: models[name] for name in ("llama", "mistral-sharp")}
    stats = fuzz(chosen, seconds=INT4_CI_SECONDS, seed=seed, int4_share=1.0, min_workloads=3, device=device)
    print(stats.line())
    assert stats.by_weights == {"weights int4": stats.workloads} and stats.tokens > 0


@pytest.mark.fuzz
def test_tp2_every_request_equals_itself_alone(models: dict[str, Path], device: str,
                                              request: pytest.FixtureRequest) -> None:
    """Every workload's batched run on two tensor-parallel ranks (gloo; the MQA model's one
    KV head replicated on both; the Phi-4-mini's fused checkpoint tensors cut per rank; OLMo
    3's q/k norms summed over the ranks; Qwen2-MoE's and gpt-oss's MXFP4 experts split by
    features; Gemma 3 vision's image embeddings sent by rank 0; LoRA adapters in
    `engine_fuzz.LORA_SHARE` of them), each request against itself alone on one rank.
    `--fuzz-minutes` runs it that long instead of CI's seconds."""
    minutes = request.config.getoption("--fuzz-minutes")
    seed = request.config.getoption("--fuzz-seed")
    chosen = {name: models[name] for name in ("llama", "llama-mqa-sharp", "phi4_mini-sharp", "olmo3-sharp",
                                              "qwen2_moe", "gpt_oss-mxfp4", "gemma3-vision")}
    stats = fuzz(chosen, seconds=minutes * 60 if minutes else TP_CI_SECONDS, seed=seed, triton_share=0.0,
                 int4_share=0.0, tp_share=1.0, min_workloads=2, device=device)
    print(stats.line())
    assert stats.by_tp == {"tp 2": stats.workloads} and stats.tokens > 0
