"""LoRA adapters through the offline Engine, against PEFT: a batch mixing adapters and the
base model gives each prompt PEFT's greedy tokens with its adapter (dense and
mixture-of-experts models, Phi-3's fused projections, cold and warm cache, chunked prefill, an int8 KV cache,
speculative decoding, retraction); prefixes cached under one adapter are never reused
under another; adapters load and unload while the engine runs, and a slot reused by
another adapter serves that adapter's tokens; what cannot be applied exactly is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from draft_checkpoints import truncated_draft
from engine_helpers import assert_idle_and_intact, make_prompts
from lora_adapters import edit_config, fused_targets, model_greedy, peft_adapter, peft_greedy
from peft import PeftModel
from quant_checkpoints import with_rtn_weights
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.quantization.formats import OnlineFormat
from sprig.runtime.request_contract import InvalidRequest

PROMPTS = make_prompts(4, seed=21)
NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0}
ENGINE = dict(dtype="float32", device="cpu", check_integrity=True)
TARGETS = {  # per adapter: the modules it adapts (its ranks differ too)
    "attn": (["q_proj", "v_proj", "o_proj"], 8),
    "mlp": (["k_proj", "gate_proj", "up_proj", "down_proj"], 4),
}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """(base, {adapter name: path}, {name or None: PEFT's greedy tokens}) per arch, on first use."""
    root = tmp_path_factory.mktemp("lora")
    cache: dict[str, tuple[Path, dict[str, Path], dict[str | None, list[list[int]]]]] = {}

    def get(arch: str):
        if arch not in cache:
            base = tiny_checkpoints[arch]
            paths = {name: peft_adapter(base, root / arch / name, seed=i, r=r, scale=20.0,
                                        targets=fused_targets(targets) if arch == "phi3" else targets)
                     for i, (name, (targets, r)) in enumerate(TARGETS.items())}
            refs = {name: peft_greedy(base, path, PROMPTS, NEW) for name, path in [(None, None), *paths.items()]}
            assert refs["attn"] != refs[None] != refs["mlp"] != refs["attn"]  # each adapter moves the tokens
            cache[arch] = (base, paths, refs)
        return cache[arch]

    return get


def mixed(engine: Engine, names: list[str | None]) -> list[list[int]]:
    """Every prompt under every name, in one batch."""
    outs = engine.generate(PROMPTS * len(names), GREEDY, lora_path=[n for n in names for _ in PROMPTS])
    return [o["output_ids"] for o in outs]


def expected(refs: dict, names: list[str | None]) -> list[list[int]]:
    return [ids for n in names for ids in refs[n]]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_moe", "gemma3", "phi3"])
def test_a_mixed_batch_equals_peft_per_adapter_cold_and_warm(arch: str, adapters) -> None:
    """(Phi-3's adapters adapt its fused qkv_proj and gate_up_proj whole, as PEFT does.)"""
    base, paths, refs = adapters(arch)
    names = [None, "attn", "mlp"]
    with Engine(str(base), **ENGINE, lora_paths={k: str(v) for k, v in paths.items()}) as engine:
        assert mixed(engine, names) == expected(refs, names)
        warm = engine.generate(PROMPTS, GREEDY, lora_path="attn")
        assert [o["output_ids"] for o in warm] == refs["attn"]
        assert sum(o["meta_info"]["cached_tokens"] for o in warm) > 0
        assert_idle_and_intact(engine)


@pytest.mark.parametrize("options", [
    {"chunked_prefill_size": 5, "page_size": 4},
    {"kv_cache_dtype": "int8"},
    {"speculative_algorithm": "ngram", "speculative_pass_costs": "1,0,0,0,0,0,0"},
    {"speculative_algorithm": "radix", "speculative_pass_costs": "1,0,0,0,0,0,0"},
    {"speculative_algorithm": "draft", "speculative_pass_costs": "1,0,0,0,0,0,0"},
    {"max_total_tokens": 80, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
], ids=["chunked-page4", "int8-kv", "ngram", "radix", "draft-model", "retraction"])
def test_each_request_equals_itself_alone_under_engine_options(options: dict, adapters) -> None:
    """(The draft model proposes as the base model: the target verifies with the adapters.)"""
    base, paths, refs = adapters("llama")
    if options.get("speculative_algorithm") == "draft":
        options = {**options, "speculative_draft_model_path": str(truncated_draft(base))}
    names = ["mlp", None, "attn"]
    lora = {k: str(v) for k, v in paths.items()}
    with Engine(str(base), **ENGINE, lora_paths=lora, **options) as engine:
        got = mixed(engine, names)
        again = mixed(engine, names)  # warm: each adapter's prefixes (the radix drafter's too) are its own
        assert_idle_and_intact(engine)
    alone = []
    with Engine(str(base), **ENGINE, lora_paths=lora, **{k: v for k, v in options.items() if k == "kv_cache_dtype"}) as e:
        for name in names:
            for p in PROMPTS:
                alone.append(e.generate(p, GREEDY, lora_path=name)["output_ids"])
    assert got == again == alone
    if "kv_cache_dtype" not in options:
        assert got == expected(refs, names)


def test_seeded_samples_equal_themselves_alone(adapters) -> None:
    base, paths, _ = adapters("llama")
    sampled = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 5}
    lora = {k: str(v) for k, v in paths.items()}
    with Engine(str(base), **ENGINE, lora_paths=lora) as engine:
        together = engine.generate(PROMPTS * 2, sampled, lora_path=["attn"] * 4 + ["mlp"] * 4)
        alone = [engine.generate(p, sampled, lora_path=n)["output_ids"] for n in ("attn", "mlp") for p in PROMPTS]
    assert [o["output_ids"] for o in together] == alone
    assert alone[:4] != alone[4:]


def test_a_prefix_cached_under_one_adapter_is_not_reused_under_another(adapters) -> None:
    base, paths, refs = adapters("llama")
    lora = {k: str(v) for k, v in paths.items()}
    with Engine(str(base), **ENGINE, lora_paths=lora) as engine:
        for name in (None, "attn", "mlp"):
            first = engine.generate(PROMPTS[0], GREEDY, lora_path=name)
            assert first["meta_info"]["cached_tokens"] == 0, name  # the others' K/V is not this one's
            assert first["output_ids"] == refs[name][0]
        again = engine.generate(PROMPTS[0], GREEDY, lora_path="mlp")
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == refs["mlp"][0]


def test_adapters_load_and_unload_while_serving(adapters, tmp_path: Path) -> None:
    """A slot freed by an unload and taken by another adapter serves the new adapter's
    tokens: the prefixes cached under the old one were dropped with it."""
    base, paths, refs = adapters("llama")
    with Engine(str(base), **ENGINE, enable_lora=True, lora_target_modules=["all"], max_lora_rank=8,
                max_loras_per_batch=1) as engine:
        assert engine.generate(PROMPTS, GREEDY, lora_path=None)[0]["output_ids"] == refs[None][0]
        answer = engine.load_lora_adapter("a", str(paths["attn"]))
        assert answer == {"success": True, "error_message": None, "loaded_adapters": {"a": str(paths["attn"])}}
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY, lora_path="a")] == refs["attn"]
        full = engine.load_lora_adapter("b", str(paths["mlp"]))
        assert not full["success"] and "all 1 LoRA slots" in full["error_message"]
        cached = engine.scheduler.kv.cache.evictable_size()
        assert engine.unload_lora_adapter("a")["loaded_adapters"] == {}
        assert engine.scheduler.kv.cache.evictable_size() < cached  # adapter a's prefixes are gone
        assert engine.load_lora_adapter("a", str(paths["mlp"]))["success"]  # the same name and slot, other weights
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY, lora_path="a")] == refs["mlp"]
        with pytest.raises(InvalidRequest, match="no LoRA adapter named 'attn' is loaded \\(loaded: 'a'\\)"):
            engine.generate(PROMPTS[0], GREEDY, lora_path="attn")
        gone = engine.unload_lora_adapter("attn")
        assert not gone["success"] and "no LoRA adapter named 'attn'" in gone["error_message"]
        assert_idle_and_intact(engine)


def test_what_cannot_be_applied_is_refused(adapters, tmp_path: Path) -> None:
    base, paths, _ = adapters("llama")
    with Engine(str(base), **ENGINE) as plain:
        with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
            plain.generate("hi", GREEDY, lora_path="attn")
        assert plain.load_lora_adapter("x", str(paths["attn"]))["error_message"].startswith("LoRA is not enabled")
    cases = {
        "use_dora True is not supported": edit_config(paths["attn"], tmp_path / "dora", use_dora=True),
        "modules_to_save ['lm_head'] is not supported": edit_config(paths["attn"], tmp_path / "save",
                                                                     modules_to_save=["lm_head"]),
        "peft_type 'IA3' is not LORA": edit_config(paths["attn"], tmp_path / "ia3", peft_type="IA3"),
        "not a PEFT LoRA adapter": tmp_path / "nothing",
        "which this server does not adapt (enabled: o_proj, q_proj, v_proj": paths["mlp"],  # k_proj and the MLP
        "rank 8 exceeds max_lora_rank 4": paths["attn"],
    }
    with Engine(str(base), **ENGINE, enable_lora=True, lora_target_modules=["q_proj", "v_proj", "o_proj"],
                max_lora_rank=4) as engine:
        for reason, path in cases.items():
            answer = engine.load_lora_adapter("x", str(path))
            assert not answer["success"] and reason in answer["error_message"], answer
            assert answer["loaded_adapters"] == {}
        with pytest.raises(InvalidRequest, match="lora_path must be an adapter name or a list of 2"):
            engine.generate(["a", "b"], GREEDY, lora_path=["x"])
    with pytest.raises(ValueError, match="LoRA needs lora_paths"):
        Engine(str(base), **ENGINE, enable_lora=True)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_quantized_base_weights_equal_peft_on_the_rounded_weights(quantization: str, adapters) -> None:
    """An adapter's delta adds to a quantized layer's output: PEFT over transformers with
    the weights the RTN codes stand for gives the same greedy tokens."""
    base, paths, _ = adapters("llama")
    fmt = OnlineFormat.of(quantization, 32)
    hf = with_rtn_weights(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), fmt.scheme)
    peft = PeftModel.from_pretrained(hf, paths["attn"]).eval()
    expected = model_greedy(peft, AutoTokenizer.from_pretrained(base), PROMPTS, NEW)
    with Engine(str(base), **ENGINE, lora_paths={"attn": str(paths["attn"])}, quantization=quantization,
                quantization_group_size=32) as engine:
        got = engine.generate(PROMPTS * 2, GREEDY, lora_path=["attn"] * 4 + [None] * 4)
        assert [o["output_ids"] for o in got[:4]] == expected
        assert [o["output_ids"] for o in got[:4]] != [o["output_ids"] for o in got[4:]]
        assert_idle_and_intact(engine)


@pytest.mark.gpu
def test_a_mixed_batch_equals_peft_on_cuda(adapters) -> None:
    """On CUDA (decode eager while LoRA is on: no graphs captured)."""
    base, paths, refs = adapters("llama")
    names = [None, "attn", "mlp"]
    with Engine(str(base), dtype="float32", device="cuda", lora_paths={k: str(v) for k, v in paths.items()}) as engine:
        assert mixed(engine, names) == expected(refs, names)
        assert engine.runner.graphs is None
        assert_idle_and_intact(engine)


def test_an_adapter_of_the_experts_is_refused(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """PEFT adapts Qwen3-MoE's stacked experts (`target_parameters`) for MLP targets."""
    base = tiny_checkpoints["qwen3_moe"]
    adapter = peft_adapter(base, tmp_path / "experts", seed=3, targets=["q_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"target_parameters .* is not supported \(LoRA on a mixture-of-experts "
                                         r"block's experts is not implemented\)"):
        Engine(str(base), **ENGINE, lora_paths={"experts": str(adapter)})


def test_embeddings_with_an_adapter_equal_peft(adapters) -> None:
    """`Engine.encode(lora_path=...)`: the adapter's model's last-token final hidden state,
    L2-normalized, as PEFT's model computes it; other prompts of the batch on the base."""
    base, paths, _ = adapters("llama")
    tok = AutoTokenizer.from_pretrained(base)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     paths["attn"]).eval()
    with torch.no_grad():
        hidden = peft(torch.tensor([tok.encode(PROMPTS[0])]), output_hidden_states=True).hidden_states[-1][0, -1]
    want = torch.nn.functional.normalize(hidden, dim=0)
    with Engine(str(base), **ENGINE, lora_paths={k: str(v) for k, v in paths.items()}) as engine:
        got = engine.encode([PROMPTS[0], PROMPTS[0]], lora_path=["attn", None])
        torch.testing.assert_close(torch.tensor(got[0]["embedding"]), want, atol=1e-5, rtol=0)
        assert (torch.tensor(got[1]["embedding"]) - want).abs().max() > 1e-2  # the base model's differs
        assert_idle_and_intact(engine)
