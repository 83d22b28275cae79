"""`Engine.update_weights_from_disk`: after an update the engine generates what transformers
generates with the new checkpoint (and what a fresh engine on it generates), on every
architecture, on two tensor-parallel ranks, with online int8 weights and with speculative
decoding; no prefix cached before the update is reused after it; a checkpoint that does not
load (missing, another shape, a missing tensor, a tensor of the wrong shape found after
most of the others were copied) leaves the old weights generating what they did.
`Engine.update_weights_from_tensor`: a transformers model's parameters after each
'training step' (all, or chunks in another dtype; a mixture-of-experts model's stacked
experts, or each expert's as a checkpoint names them) make the engine generate what that
model does; tensors that do not fit change nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, hf_greedy, make_prompts
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from weight_checkpoints import edited_copy, perturbed_copy

from sprig.runtime import Engine
from sprig.runtime.tiny_checkpoint import ARCHITECTURES, MOE_ARCHITECTURES, build_tiny_checkpoint

ENGINE = dict(dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=2048)
NEW_TOKENS = 10
PROMPTS = make_prompts(4, seed=11)


def greedy(engine: Engine, prompts: list[str] = PROMPTS) -> list[list[int]]:
    outs = engine.generate(prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0})
    return [o["output_ids"] for o in outs]


def fresh_greedy(path: Path, prompts: list[str] = PROMPTS, **kwargs) -> list[list[int]]:
    with Engine(str(path), **(ENGINE | kwargs)) as engine:
        return greedy(engine, prompts)


@pytest.fixture(scope="module")
def stepped(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny checkpoint after a 'training step': the same model, other weights."""
    root = tmp_path_factory.mktemp("stepped")
    return {arch: perturbed_copy(path, root / arch, seed=1) for arch, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHITECTURES + MOE_ARCHITECTURES)
def test_updated_weights_generate_what_transformers_does(arch: str, tiny_checkpoints: dict[str, Path],
                                                         stepped: dict[str, Path]) -> None:
    old, new = tiny_checkpoints[arch], stepped[arch]
    expected_old, expected_new = hf_greedy(old, PROMPTS, NEW_TOKENS), hf_greedy(new, PROMPTS, NEW_TOKENS)
    assert expected_old != expected_new  # the step changed what the model says
    with Engine(str(old), **ENGINE) as engine:
        assert greedy(engine) == expected_old
        assert engine.update_weights_from_disk(str(new)) == (True, "Succeeded to update model weights.", 0)
        assert greedy(engine) == expected_new
        assert engine.runner.config.model_path == str(new)
        assert engine.update_weights_from_disk(str(old))[0]
        assert greedy(engine) == expected_old
        assert_idle_and_intact(engine)


def test_no_prefix_cached_before_an_update_is_reused(tiny_llama: Path, stepped: dict[str, Path]) -> None:
    shared = "the quick red fox and the blue dog went to the cache tree with one two three requests " * 2
    prompts = [shared + p for p in PROMPTS]
    with Engine(str(tiny_llama), **ENGINE) as engine:
        greedy(engine, prompts)  # the shared prefix is now cached, its K/V from the old weights
        assert engine.scheduler.kv.cache.evictable_size() > 0
        engine.update_weights_from_disk(str(stepped["llama"]))
        assert engine.scheduler.kv.cache.evictable_size() == 0
        first = engine.generate(prompts[0], {"max_new_tokens": NEW_TOKENS, "temperature": 0})
        assert first["meta_info"]["cached_tokens"] == 0
        assert [first["output_ids"], *greedy(engine, prompts[1:])] == fresh_greedy(stepped["llama"], prompts)
        assert_idle_and_intact(engine)


def test_a_checkpoint_in_another_dtype_is_converted(tiny_llama: Path, tmp_path: Path) -> None:
    half = perturbed_copy(tiny_llama, tmp_path / "bf16", seed=2, dtype=torch.bfloat16)
    with Engine(str(tiny_llama), **ENGINE) as engine:
        assert engine.update_weights_from_disk(str(half))[0]
        assert engine.runner.dtype == torch.float32
        assert greedy(engine) == hf_greedy(half, PROMPTS, NEW_TOKENS)


def _drop(name: str):
    return lambda w: {k: v for k, v in w.items() if k != name}


def _truncate(name: str):
    return lambda w: w | {name: w[name][:-1]}


def test_a_checkpoint_that_does_not_load_leaves_the_old_weights(tiny_llama: Path, stepped: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    new = stepped["llama"]
    deeper = build_tiny_checkpoint(tmp_path / "deeper", "llama", num_hidden_layers=3)
    cases = {  # path -> what the message must say
        tmp_path / "absent": "is not a directory",
        deeper: "num_layers 2 -> 3",
        edited_copy(new, tmp_path / "missing", _drop("model.layers.1.mlp.up_proj.weight")):
            "missing tensor(s) model.layers.1.mlp.up_proj.weight",
        # sorted last, so every other (changed) tensor is copied before this one fails
        edited_copy(new, tmp_path / "misshaped", _truncate("model.norm.weight")): "'model.norm.weight' has shape [63]",
    }
    with Engine(str(tiny_llama), **ENGINE, weight_version="v0") as engine:
        before = greedy(engine)
        for path, reason in cases.items():
            ok, message, paused = engine.update_weights_from_disk(str(path), weight_version="v1")
            assert not ok and paused == 0
            assert reason in message and f"the weights of {tiny_llama} are in place" in message, message
            assert greedy(engine) == before, path.name
            assert engine.runner.config.model_path == str(tiny_llama)
            assert engine.scheduler.weight_version == "v0"
        assert engine.update_weights_from_disk(str(new))[0]
        assert greedy(engine) == hf_greedy(new, PROMPTS, NEW_TOKENS)
        assert_idle_and_intact(engine)


def test_weight_versions_label_the_responses(tiny_llama: Path, stepped: dict[str, Path]) -> None:
    with Engine(str(tiny_llama), **ENGINE, weight_version="step-0") as engine:
        params = {"max_new_tokens": 2}
        assert engine.generate("a", params)["meta_info"]["weight_version"] == "step-0"
        ok, message, _ = engine.update_weights_from_disk(str(stepped["llama"]), weight_version="step-1")
        assert ok and message == "Succeeded to update model weights. Weight version updated to step-1."
        assert [o["meta_info"]["weight_version"] for o in engine.generate(["a", "b"], params)] == ["step-1"] * 2
        assert engine.update_weights_from_disk(str(tiny_llama))[0]  # no new label: the old one stays
        assert engine.generate("a", params)["meta_info"]["weight_version"] == "step-1"
        for bad, field in [({"load_format": "pt"}, "load_format"), ({"weight_version": ""}, "weight_version")]:
            ok, message, _ = engine.update_weights_from_disk(str(tiny_llama), **bad)
            assert not ok and field in message


def test_refused_while_requests_are_in_flight(tiny_llama: Path, stepped: dict[str, Path]) -> None:
    with Engine(str(tiny_llama), **ENGINE) as engine:
        async def main() -> tuple[tuple[bool, str, int], dict]:
            call = asyncio.ensure_future(engine.async_generate(
                "the fox", {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}))
            await asyncio.sleep(0)
            refused = engine.update_weights_from_disk(str(stepped["llama"]))
            return refused, await call

        refused, out = asyncio.run(main())
        assert refused[0] is False and "in flight" in refused[1]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert engine.runner.config.model_path == str(tiny_llama)
        stream = engine.generate("the fox", {"max_new_tokens": 8, "temperature": 0}, stream=True)
        first = next(stream)
        for refused in (engine.update_weights_from_disk(str(stepped["llama"])),
                        engine.update_weights_from_tensor([("model.norm.weight", torch.ones(64))])):
            assert refused[0] is False and "a generate stream is being read" in refused[1]
        last = list(stream)[-1]
        assert last["output_ids"][: len(first["output_ids"])] == first["output_ids"]
        assert engine.runner.config.model_path == str(tiny_llama)
        assert engine.update_weights_from_disk(str(stepped["llama"]))[0]


def test_online_int8_weights_are_quantized_again(tiny_llama: Path, stepped: dict[str, Path], tmp_path: Path) -> None:
    new = stepped["llama"]
    # the v projection fails after the q and k projections of its fused layer were staged
    broken = edited_copy(new, tmp_path / "broken", _truncate("model.layers.1.self_attn.v_proj.weight"))
    with Engine(str(tiny_llama), **ENGINE, quantization="int8") as engine:
        before = greedy(engine)
        assert not engine.update_weights_from_disk(str(broken))[0]
        assert greedy(engine) == before
        assert engine.update_weights_from_disk(str(new))[0]
        assert greedy(engine) == fresh_greedy(new, quantization="int8")
        assert_idle_and_intact(engine)


def test_speculative_decoding_runs_on_the_new_weights(tiny_llama: Path, stepped: dict[str, Path]) -> None:
    new = stepped["llama"]
    with Engine(str(tiny_llama), **ENGINE, speculative_algorithm="ngram") as engine:
        greedy(engine)
        assert engine.update_weights_from_disk(str(new))[0]
        assert greedy(engine) == hf_greedy(new, PROMPTS, NEW_TOKENS)
        assert_idle_and_intact(engine)


def test_every_tensor_parallel_rank_loads_or_none_does(tiny_llama: Path, stepped: dict[str, Path],
                                                      tmp_path: Path) -> None:
    new = stepped["llama"]
    misshaped = edited_copy(new, tmp_path / "misshaped", _truncate("model.norm.weight"))
    with Engine(str(tiny_llama), **ENGINE, tp_size=2) as engine:
        before = greedy(engine)
        ok, message, _ = engine.update_weights_from_disk(str(misshaped))
        assert not ok and "'model.norm.weight' has shape" in message
        assert greedy(engine) == before
        assert engine.update_weights_from_disk(str(new))[0]
        assert greedy(engine) == hf_greedy(new, PROMPTS, NEW_TOKENS)
        assert_idle_and_intact(engine)


def hf_model_greedy(model: torch.nn.Module, tokenizer, prompts: list[str] = PROMPTS) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tokenizer.encode(p)])
            outs.append(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
                        .tolist())
    return outs


def _step(model: torch.nn.Module, seed: int, only: str = "") -> None:
    """A 'training step' in place: noise on every parameter whose name contains `only`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("tied", [False, True])
def test_tensors_of_a_trained_model_replace_the_weights(tiny_llama: Path, tmp_path: Path, tied: bool) -> None:
    path = build_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True) if tied else tiny_llama
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with Engine(str(path), **ENGINE, weight_version="0") as engine:
        assert greedy(engine) == hf_model_greedy(policy, tokenizer)
        for step in (1, 2):
            _step(policy, seed=step)
            ok, message = engine.update_weights_from_tensor(list(policy.named_parameters()), weight_version=str(step))
            assert ok, message
            expected = hf_model_greedy(policy, tokenizer)
            assert greedy(engine) == expected
        assert message == f"Succeeded to update model weights ({len(list(policy.parameters()))} tensors). " \
                          "Weight version updated to 2."
        assert engine.generate("a", {"max_new_tokens": 1})["meta_info"]["weight_version"] == "2"
        assert_idle_and_intact(engine)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tensors_of_a_trained_moe_model_in_either_naming(arch: str, tiny_checkpoints: dict[str, Path],
                                                         stepped: dict[str, Path]) -> None:
    """transformers' own names (Mixtral's block as `mlp`, each layer's experts stacked in
    `experts.gate_up_proj` and `experts.down_proj`), then a checkpoint's (one tensor per
    expert and projection, Mixtral's `block_sparse_moe.experts.{e}.w1`)."""
    path = tiny_checkpoints[arch]
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with Engine(str(path), **ENGINE) as engine:
        _step(policy, seed=5)
        assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in policy.named_parameters())
        ok, message = engine.update_weights_from_tensor(list(policy.named_parameters()))
        assert ok, message
        assert greedy(engine) == hf_model_greedy(policy, tokenizer)
        new = stepped[arch]
        with safe_open(str(new / "model.safetensors"), framework="pt") as f:
            tensors = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
        expert = "block_sparse_moe.experts.3.w2.weight" if arch == "mixtral" else "mlp.experts.3.down_proj.weight"
        assert any(name.endswith(expert) for name, _ in tensors)
        ok, message = engine.update_weights_from_tensor(tensors)
        assert ok, message
        assert greedy(engine) == hf_greedy(new, PROMPTS, NEW_TOKENS)
        name = f"model.layers.1.{expert}"
        assert engine.get_weights_by_name(name, 2) == dict(tensors)[name][:2].tolist()
        assert_idle_and_intact(engine)


def test_partial_tensor_updates_in_half_precision(tiny_llama: Path) -> None:
    """Chunks of a trained model's tensors, bfloat16, the first ones with flush_cache=False
    (as SGLang's callers send all but the last): the cache is dropped each time anyway."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with Engine(str(tiny_llama), **ENGINE) as engine:
        _step(policy, seed=3, only="layers.1.")
        changed = [(n, p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters() if "layers.1." in n]
        with torch.no_grad():  # the reference holds what the engine receives
            for name, p in policy.named_parameters():
                if "layers.1." in name:
                    p.copy_(p.to(torch.bfloat16))
        for i, chunk in enumerate((changed[:3], changed[3:])):
            greedy(engine)  # something cached between the chunks
            ok, message = engine.update_weights_from_tensor(chunk, flush_cache=i == 1)
            assert ok, message
            assert engine.scheduler.kv.cache.evictable_size() == 0
        assert greedy(engine) == hf_model_greedy(policy, tokenizer)


def test_tensors_that_do_not_fit_change_nothing(tiny_llama: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    _step(policy, seed=4)
    good = list(policy.named_parameters())
    q = dict(good)["model.layers.0.self_attn.q_proj.weight"]
    cases = {  # the good tensors first, so a partial copy would show
        "'model.layers.0.self_attn.q_proj.weight' has shape [63, 64]":
            [*[t for t in good if t[1] is not q], ("model.layers.0.self_attn.q_proj.weight", q[:-1])],
        "'model.layers.9.mlp.up_proj.weight' is no parameter": [*good, ("model.layers.9.mlp.up_proj.weight", q)],
        "'lm_head.weight' is given twice": [*good, good[-1]],
    }
    with Engine(str(tiny_llama), **ENGINE) as engine:
        before = greedy(engine)
        for reason, tensors in cases.items():
            ok, message = engine.update_weights_from_tensor(tensors)
            assert not ok and message.startswith("no weight was updated: ") and reason in message, message
            assert greedy(engine) == before
        assert engine.update_weights_from_tensor(good, load_format="flattened_bucket") == (
            False, "load_format must be null or 'direct' (tensors are copied as they are), got 'flattened_bucket'")
    with Engine(str(tiny_llama), **ENGINE, quantization="int8") as engine:
        before = greedy(engine)
        ok, message = engine.update_weights_from_tensor(good)
        assert not ok and "belongs to a quantized layer" in message
        assert greedy(engine) == before
    with Engine(str(tiny_llama), **ENGINE, tp_size=2) as engine:
        ok, message = engine.update_weights_from_tensor(good)
        assert not ok and "tensor-parallel" in message
        with pytest.raises(ValueError, match="tensor-parallel"):
            engine.get_weights_by_name("model.norm.weight")


def test_weights_read_back_by_name(tiny_llama: Path, stepped: dict[str, Path], tmp_path: Path) -> None:
    new = stepped["llama"]
    weights = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict()
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",  # slices of fused ones
             "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"]
    with Engine(str(tiny_llama), **ENGINE) as engine:
        assert engine.get_weights_by_name(names[0], 2) != weights[names[0]][:2].tolist()
        assert engine.update_weights_from_disk(str(new))[0]
        for name in names:
            assert engine.get_weights_by_name(name, truncate_size=3) == weights[name][:3].tolist(), name
        assert len(engine.get_weights_by_name("model.norm.weight")) == 64  # 100 rows asked, 64 there
        with pytest.raises(ValueError, match=r"'model\.layers\.7\.mlp\.up_proj\.weight' is no parameter"):
            engine.get_weights_by_name("model.layers.7.mlp.up_proj.weight")
        with pytest.raises(ValueError, match="truncate_size must be >= 1"):
            engine.get_weights_by_name("model.norm.weight", 0)
    tied = build_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    with Engine(str(tied), **ENGINE) as engine:  # a tied head reads the embedding
        assert engine.get_weights_by_name("lm_head.weight", 2) == engine.get_weights_by_name("model.embed_tokens.weight", 2)
    with Engine(str(tiny_llama), **ENGINE, quantization="int8") as engine:
        with pytest.raises(ValueError, match="quantized layer"):
            engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight")
        norm = AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict()["model.norm.weight"]
        assert engine.get_weights_by_name("model.norm.weight", 2) == norm[:2].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_graphs_run_the_new_weights_on_cuda(tiny_llama: Path, stepped: dict[str, Path],
                                                   quantization: str | None) -> None:
    """Float weights are copied into the tensors the captured graphs read; quantized layers
    are rebuilt, so the graphs are captured again: either way an updated engine decodes
    (in graphs) what a fresh engine on the new checkpoint does."""
    new = stepped["llama"]
    cuda = dict(device="cuda", dtype="float32", quantization=quantization)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with Engine(str(new), **cuda) as fresh:
        want = [o["output_ids"] for o in fresh.generate(PROMPTS, params)]
    with Engine(str(tiny_llama), **cuda) as engine:
        before = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
        assert engine.runner.graphs.captured  # the old weights' graphs ran
        assert engine.update_weights_from_disk(str(new))[0]
        assert [o["output_ids"] for o in engine.generate(PROMPTS, params)] == want != before
        assert engine.runner.graphs.captured
        assert_idle_and_intact(engine)
