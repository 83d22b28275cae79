"""The int8 KV cache (`kv_cache_dtype="int8"`) through the runtime: the pool holds more
tokens in the same bytes, every attention backend reads the same dequantized cache as the
reference (decode steps with kept K/V and shared prefixes included), shadow mode still
compares fast against plain, a request's tokens do not depend on what runs beside it,
and the configuration refuses what it cannot run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, contexts_step, make_prompts

from sprig.kernels.kv_quant import dequantize_kv_ref
from sprig.radix.kv_cache import KVCache, KVShape, slots_for_budget
from sprig.runtime import Engine, model_runner
from sprig.runtime.attention import backend_class
from sprig.runtime.attention.cpu import kept_kv
from sprig.runtime.attention.shadow import ShadowMismatch
from sprig.runtime.cli import build_parser, configs_from_args
from sprig.runtime.demo.evaluate import prompts as demo_prompts
from sprig.runtime.demo.tasks import take
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import build_forward_batch
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig

CPU = torch.device("cpu")

# ---------------------------------------------------------------- sizing


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_same_budget_holds_about_4x_float32_and_2x_bf16_tokens(head_dim: int) -> None:
    budget = 8 << 30
    slots = {
        name: slots_for_budget(budget, KVShape(32, 8, head_dim, dtype, storage))
        for name, dtype, storage in [
            ("float32", torch.float32, None), ("bfloat16", torch.bfloat16, None), ("int8", torch.bfloat16, torch.int8),
        ]
    }
    vs_f32, vs_bf16 = slots["int8"] / slots["float32"], slots["int8"] / slots["bfloat16"]
    print(f"head_dim {head_dim}, 32 layers x 8 KV heads in 8 GiB: {slots} tokens; int8 holds "
          f"{vs_f32:.2f}x float32 and {vs_bf16:.2f}x bfloat16")
    assert vs_f32 >= 3.8 and vs_bf16 >= 1.9
    # scales count: one float16 per token, KV head and K or V
    assert KVShape(32, 8, head_dim, torch.bfloat16, torch.int8).bytes_per_token == 2 * 32 * 8 * (head_dim + 2)


def test_the_runner_sizes_an_int8_pool_by_its_bytes(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU default holds the bytes of CPU_DEFAULT_TOKENS float tokens, and a byte budget
    (here the CPU cap, made to bind) holds as many tokens as fit, scales counted."""
    def runners() -> dict[str, ModelRunner]:
        return {kd: ModelRunner(RunnerConfig(tiny_llama, dtype="float32", device="cpu", kv_cache_dtype=kd))
                for kd in ("auto", "int8")}

    D = ModelConfig.from_pretrained(tiny_llama).head_dim
    for budget in (None, 1 << 20):
        if budget is not None:
            monkeypatch.setattr(model_runner, "CPU_KV_BUDGET_BYTES", budget)
        plain, quant = (r.kv_cache for r in runners().values())
        assert quant.k[0].dtype == torch.int8 and quant.k_scale[0].dtype == torch.float16
        assert quant.k_scale[0].shape == quant.k[0].shape[:2] and plain.k_scale == []
        assert quant.nbytes() <= plain.nbytes() < quant.nbytes() + 2 * plain.shape.bytes_per_token
        assert quant.num_slots / plain.num_slots == pytest.approx(4 * D / (D + 2), rel=0.01)  # 3.56x at D = 16
    assert plain.num_slots < model_runner.CPU_DEFAULT_TOKENS  # the budget bound
    with pytest.raises(ValueError, match="float pools only"):
        quant.store(0, torch.tensor([1]), torch.zeros(1, *quant.k[0].shape[1:]), torch.zeros(1, *quant.k[0].shape[1:]))


# ---------------------------------------------------------------- every backend reads what the reference reads


def _pools(config: ModelConfig, n: int, device: torch.device = CPU) -> list[KVCache]:
    """n equal int8 pools holding random quantized K/V: the prefixes."""
    shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, torch.int8)
    pools = [KVCache(shape, 160, device=device) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    for layer in range(config.num_layers):
        for name in ("k", "v", "k_scale", "v_scale"):
            init = getattr(pools[0], name)[layer]
            init.copy_((torch.randint(-127, 128, init.shape, generator=g) if name in ("k", "v")
                        else torch.rand(init.shape, generator=g) / 50).to(device))
            for pool in pools[1:]:
                getattr(pool, name)[layer].copy_(init)
    return pools


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backends_read_the_int8_pool_as_the_reference_does(tiny_llama: Path, name: str) -> None:
    """An extend step (two requests share a 40-slot prefix: cascade attention), then decode
    steps (kept K/V extended step by step), every layer: each backend's output equals the
    reference backend's on its own copy of the pool, and the pools stay bit-equal. Triton
    runs compiled on CUDA, in its interpreter on the CPU."""
    device = torch.device("cuda") if name == "triton" and torch.cuda.is_available() else CPU
    config = ModelConfig.from_pretrained(tiny_llama)
    mine, ref_pool = _pools(config, 2, device)
    backend = backend_class(name)(config, mine)
    reference = backend_class("reference")(config, ref_pool)
    shared = torch.arange(100, 140)
    contexts = [torch.cat([shared, torch.arange(10, 13)]), torch.cat([shared, torch.arange(20, 25)]), torch.arange(30, 37)]
    new = [3, 5, 7]  # new tokens per request in the extend step
    g = torch.Generator().manual_seed(3)
    T_heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    for step in range(4):
        mode = ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE
        if step:
            contexts = [torch.cat([c, torch.tensor([60 + 3 * step + i])]) for i, c in enumerate(contexts)]
            new = [1, 1, 1]
        batch, _ = build_forward_batch(contexts_step(mode, [0] * sum(new), new, contexts, [0] * 3), mine, device)
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        backend.begin_step(batch)
        reference.begin_step(ref_batch)
        for layer in range(config.num_layers):
            q = torch.randn(batch.num_tokens, T_heads[0], T_heads[2], generator=g).to(device)
            k, v = (torch.randn(batch.num_tokens, T_heads[1], T_heads[2], generator=g).to(device) for _ in range(2))
            got = backend.forward(q, k, v, layer, batch, sm_scale=0.25)
            want = reference.forward(q, k, v, layer, ref_batch, sm_scale=0.25)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            for buf in ("k", "v", "k_scale", "v_scale"):
                assert torch.equal(getattr(mine, buf)[layer], getattr(ref_pool, buf)[layer])
    if name == "torch":
        assert len(backend.kept_kv.tails) > 0 and len(backend.kept_kv.prefixes) > 0  # the fast paths ran


def test_the_reference_over_an_int8_pool_is_the_reference_over_its_dequantized_values(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = _pools(config, 1)
    shape = dataclasses.replace(pool.shape, storage=None)
    dequantized = KVCache(shape, pool.num_slots)
    contexts = [torch.arange(100, 140), torch.arange(30, 37)]
    batch, _ = build_forward_batch(contexts_step(ForwardMode.DECODE, [0, 0], [1, 1], contexts, [0, 0]), pool, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, config.num_heads, config.head_dim, generator=g)
    k, v = (torch.randn(2, config.num_kv_heads, config.head_dim, generator=g) for _ in range(2))
    got = backend_class("reference")(config, pool).forward(q, k, v, 0, batch, sm_scale=0.25)
    kv = pool.layers[0]  # the new tokens are stored (quantized) by now
    dequantized.k[0].copy_(dequantize_kv_ref(kv.k, kv.k_scale, torch.float32))
    dequantized.v[0].copy_(dequantize_kv_ref(kv.v, kv.v_scale, torch.float32))
    plain_batch = dataclasses.replace(batch, kv_cache=dequantized, out_cache_loc=batch.out_cache_loc[:0])
    want = backend_class("reference")(config, dequantized).forward(q, k[:0], v[:0], 0, plain_batch, sm_scale=0.25)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- shadow mode and batch invariance


def _shared_workload() -> tuple[list[str], list[dict]]:
    system = " ".join(make_prompts(4, seed=10))
    prompts = [system + " " + p for p in make_prompts(5, seed=11)] + make_prompts(2, seed=12)
    params = [{"max_new_tokens": 3 + 3 * (i % 4), "temperature": 0, "ignore_eos": True} for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shadow_mode_passes_with_int8_and_decodes_as_without_it(tiny_llama: Path, backend: str) -> None:
    prompts, params = _shared_workload()
    if backend == "triton":  # the interpreter is slow: fewer, shorter requests
        prompts, params = prompts[:2] + prompts[-1:], [{**p, "max_new_tokens": 3} for p in params[:3]]
    outs = {}
    for shadow in (False, True):
        with Engine(str(tiny_llama), dtype="float32", attention_backend=backend, kv_cache_dtype="int8",
                    shadow_attention=shadow) as engine:
            outs[shadow] = [o["output_ids"] for o in engine.generate(prompts, params)]
            assert_idle_and_intact(engine)
            if shadow:
                assert engine.runner.backend.checked >= 2 * engine.runner.backend.steps > 0
    assert outs[True] == outs[False]


def test_shadow_mode_catches_kept_kv_that_skip_dequantization(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast path of the CPU attention that reads the int8 values without their scales
    fails at once."""
    monkeypatch.setattr(kept_kv, "gather_kv", lambda buffer, rows, scale, dtype: buffer.index_select(0, rows).to(dtype))
    prompts, params = _shared_workload()
    with Engine(str(tiny_llama), device="cpu", dtype="float32", kv_cache_dtype="int8", shadow_attention=True) as engine, \
            pytest.raises(ShadowMismatch, match="decode"):
        engine.generate(prompts, params)


def test_demo_problems_all_at_once_equal_each_alone_with_int8() -> None:
    problems = take("heldout", 6, seed=1)
    greedy = {"max_new_tokens": 64, "temperature": 0}
    sampled = {**greedy, "temperature": 0.6, "top_p": 0.9, "n": 2, "seed": 5}
    with Engine(None, kv_cache_dtype="int8", check_integrity=True) as engine:
        texts = demo_prompts(engine.tokenizer, problems)
        alone_greedy, alone_sampled = [], []
        for text in texts:
            engine.flush_cache()
            alone_greedy.append(engine.generate(text, greedy)["output_ids"])
            engine.flush_cache()
            alone_sampled += [o["output_ids"] for o in engine.generate(text, sampled)]
    with Engine(None, kv_cache_dtype="int8", check_integrity=True, shadow_attention=True) as engine:
        together_greedy = [o["output_ids"] for o in engine.generate(texts, greedy)]
        together_sampled = [o["output_ids"] for o in engine.generate(texts, sampled)]
        assert_idle_and_intact(engine)
    assert together_greedy == alone_greedy and together_sampled == alone_sampled
    assert len({len(ids) for ids in alone_greedy}) > 2  # requests left the batch at different steps


# ---------------------------------------------------------------- configuration


def test_bad_kv_cache_dtypes_are_refused_by_name(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        RunnerConfig(tiny_llama, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"fp8_e4m3.*CUDA"):
        RunnerConfig(tiny_llama, device="cpu", kv_cache_dtype="fp8_e4m3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"fp8_e4m3.*CUDA"):
            ModelRunner(RunnerConfig(tiny_llama, kv_cache_dtype="fp8_e4m3"))


def test_the_cli_flag_reaches_the_runner(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--kv-cache-dtype", "int8"])
    assert configs_from_args(args)[1].runner.kv_cache_dtype == "int8"
    default = build_parser().parse_args(["serve", "--model", str(tiny_llama)])
    assert configs_from_args(default)[1].runner.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert "kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_caches_on_cuda_pass_shadow_mode(tiny_llama: Path, kv_cache_dtype: str) -> None:
    prompts, params = _shared_workload()
    outs = {}
    for shadow in (False, True):
        with Engine(str(tiny_llama), dtype="bfloat16", device="cuda", kv_cache_dtype=kv_cache_dtype,
                    shadow_attention=shadow) as engine:
            outs[shadow] = [o["output_ids"] for o in engine.generate(prompts, params)]
            assert engine.runner.kv_cache.k[0].dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
            assert_idle_and_intact(engine)
    assert outs[True] == outs[False]
