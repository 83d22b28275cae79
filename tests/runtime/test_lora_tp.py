"""LoRA adapters under tensor parallelism (TP=2 over gloo on the CPU): a batch mixing two
adapters and the base model gives the tp=1 engine's greedy tokens and, within the TP
tests' 1e-4, its prompt and output logprobs (a dense model, one whose single KV head is
replicated on both ranks, a mixture-of-experts model, int8 base weights, Phi-3's fused
projections); an adapter loaded while serving (every rank its part) and an unload do the
same; a load one rank refuses is refused by all and the engine serves on."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle_and_intact, make_prompts
from lora_adapters import fused_targets, peft_adapter

from sprig.runtime import Engine
from sprig.runtime.lora.manager import RankSync
from sprig.runtime.request_contract import InvalidRequest
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

PROMPTS = make_prompts(3, seed=21)
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=2048, chunked_prefill_size=16,
              check_integrity=True, lora_target_modules=["all"], max_lora_rank=8)
ADAPTERS = {  # name: (modules, rank, extra LoraConfig settings)
    "attn": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, {}),
    "mlp": (["gate_proj", "up_proj", "down_proj"], 4, {}),
    "late": (["q_proj", "o_proj", "up_proj", "down_proj"], 8, {"use_rslora": True}),  # loaded while serving
    "big": (["q_proj"], 16, {}),  # above max_lora_rank: refused
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints and "gqa1": one KV head (k/v replicated at TP=2), a tied head."""
    gqa1 = build_tiny_checkpoint(tmp_path_factory.mktemp("lora_tp") / "gqa1", "llama", num_key_value_heads=1,
                                 tie_word_embeddings=True, vocab_size=301)
    return {**tiny_checkpoints, "gqa1": gqa1}


@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """{adapter name: path} per checkpoint, written by PEFT on first use."""
    root = tmp_path_factory.mktemp("lora_tp_adapters")
    cache: dict[str, dict[str, Path]] = {}

    def get(arch: str) -> dict[str, Path]:
        if arch not in cache:
            cache[arch] = {name: peft_adapter(checkpoints[arch], root / arch / name, seed=i, r=r, scale=20.0,
                                              targets=fused_targets(targets) if arch == "phi3" else targets, **extra)
                           for i, (name, (targets, r, extra)) in enumerate(ADAPTERS.items())}
        return cache[arch]

    return get


def mixed(engine: Engine, names: list[str | None]) -> list[dict]:
    """Every prompt under every name, in one batch, with prompt and output logprobs."""
    return engine.generate(PROMPTS * len(names), GREEDY, lora_path=[n for n in names for _ in PROMPTS],
                           return_logprob=True, logprob_start_len=0)


def assert_same(got: list[dict], expected: list[dict]) -> None:
    """The same tokens, and logprobs within the TP tests' 1e-4."""
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la = [e[0] for e in a["meta_info"][key] if e[0] is not None]
            lb = [e[0] for e in b["meta_info"][key] if e[0] is not None]
            assert len(la) == len(lb)
            worst = max([worst, *(abs(x - y) for x, y in zip(la, lb, strict=True))])
    assert worst < 1e-4, worst


def serve(base: Path, paths: dict[str, Path], tp: int, **options: object) -> dict[str, list[dict]]:
    """What an engine at `tp` answers, started with adapters attn and mlp: a mixed batch;
    after loading late, another; after unloading mlp and refusing big, the latter again."""
    start = {name: str(paths[name]) for name in ("attn", "mlp")}
    out = {}
    with Engine(str(base), **ENGINE, **options, tp_size=tp, lora_paths=start) as engine:
        out["start"] = mixed(engine, [None, "attn", "mlp"])
        assert engine.load_lora_adapter("late", str(paths["late"]))["success"]
        out["loaded"] = mixed(engine, ["late", None, "attn", "mlp"])
        assert engine.unload_lora_adapter("mlp")["loaded_adapters"] == {"attn": start["attn"],
                                                                         "late": str(paths["late"])}
        with pytest.raises(InvalidRequest, match="no LoRA adapter named 'mlp' is loaded"):
            engine.generate(PROMPTS[0], GREEDY, lora_path="mlp")
        refused = engine.load_lora_adapter("big", str(paths["big"]))
        assert not refused["success"] and "rank 16 exceeds max_lora_rank 8" in refused["error_message"]
        assert set(refused["loaded_adapters"]) == {"attn", "late"}
        out["after"] = mixed(engine, ["late", None, "attn"])
        assert_idle_and_intact(engine)
        if tp == 1:  # a rank that reads an adapter but hears that another could not: nothing loads
            engine.runner.lora.sync = RankSync(agree=lambda ok: False, announce=None)
            lone = engine.load_lora_adapter("mlp", str(paths["mlp"]))
            assert "another tensor-parallel rank could not load it" in lone["error_message"]
            assert set(lone["loaded_adapters"]) == {"attn", "late"}
    return out


def test_adapters_at_tp2_equal_tp1_loaded_unloaded_and_refused(checkpoints: dict[str, Path], adapters) -> None:
    """On int8 base weights: the split quantized layers (o and down summed by their own
    all-reduce) take adapters, loaded at start and while serving, as the float ones do."""
    base, paths = checkpoints["llama"], adapters("llama")
    expected = serve(base, paths, tp=1, quantization="int8")
    tokens = [o["output_ids"] for o in expected["loaded"]]
    n = len(PROMPTS)
    assert len({str(tokens[i * n : (i + 1) * n]) for i in range(4)}) == 4  # each adapter moves the tokens
    got = serve(base, paths, tp=2, quantization="int8")
    for key in ("start", "loaded", "after"):
        assert_same(got[key], expected[key])
    assert [o["output_ids"] for o in got["after"]] == [o["output_ids"] for o in expected["loaded"][: 3 * n]]


@pytest.mark.parametrize("name", ["gqa1", "qwen2_moe", "phi3"])
def test_a_mixed_batch_at_tp2_equals_tp1(name: str, checkpoints: dict[str, Path], adapters) -> None:
    """Float weights. gqa1: each rank keeps the rows of k/v's B of the KV head it
    replicates; qwen2_moe: attention (each rank its KV head's rows) and the shared expert's
    MLP adapted, the experts and the router not; phi3: adapters of its fused qkv_proj and
    gate_up_proj, cut into the shards and then into each rank's rows."""
    base, paths = checkpoints[name], adapters(name)
    lora = {name: str(paths[name]) for name in ("attn", "mlp")}
    results = []
    for tp in (1, 2):
        with Engine(str(base), **ENGINE, tp_size=tp, lora_paths=lora) as engine:
            results.append(mixed(engine, [None, "attn", "mlp"]))
            assert_idle_and_intact(engine)
    tokens = [o["output_ids"] for o in results[0]]
    assert tokens[:3] != tokens[3:6] != tokens[6:] != tokens[:3]
    assert_same(results[1], results[0])
