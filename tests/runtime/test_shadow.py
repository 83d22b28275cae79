"""Shadow mode: every layer's attention is checked against the plain reference backend.
It passes on the real backends through workloads where requests share prefixes and leave
at different steps, and it catches a backend that hands a request another's rows or
serves stale kept K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_helpers import POOL, build_batch, decode_step, fresh
from engine_helpers import assert_idle_and_intact, make_prompts

from sprig.radix.kv_cache import KVCache, KVShape
from sprig.runtime import Engine
from sprig.runtime.attention import make_backend
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.attention.shadow import ShadowAttention, ShadowMismatch
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig


def workload(tok_prompt: str) -> tuple[list[str], list[dict]]:
    """Prompts sharing a long prefix (and some not), stopping after different numbers of
    tokens: decode batches shrink step by step."""
    prompts = [tok_prompt + " " + p for p in make_prompts(6, seed=11)] + make_prompts(3, seed=12)
    params = [{"max_new_tokens": 3 + 4 * (i % 4), "temperature": 0, "ignore_eos": True} for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_backends_pass_shadow_mode_and_decode_as_without_it(tiny_llama: Path, backend: str) -> None:
    system = " ".join(make_prompts(4, seed=10))
    prompts, params = workload(system)
    if backend == "triton":  # the interpreter is slow: fewer, shorter requests
        prompts, params = prompts[:3] + prompts[-1:], [{**p, "max_new_tokens": 3 + i} for i, p in enumerate(params[:4])]
    outs = {}
    for shadow in (False, True):
        with Engine(str(tiny_llama), dtype="float32", attention_backend=backend, shadow_attention=shadow) as engine:
            outs[shadow] = [o["output_ids"] for o in engine.generate(prompts, params)]
            assert_idle_and_intact(engine)
            if shadow:
                checked = engine.runner.backend
                assert isinstance(checked, ShadowAttention) and checked.checked >= 2 * checked.steps > 0
    assert outs[True] == outs[False]


class RowsSwapped(TorchAttentionBackend):
    """A broken backend: on a decode step of several requests, the first two requests
    get each other's attention."""

    def forward(self, q, k, v, layer, batch, *, sm_scale, window=None, softcap=None, sinks=None):
        out = super().forward(q, k, v, layer, batch, sm_scale=sm_scale, window=window, softcap=softcap, sinks=sinks)
        if batch.mode is ForwardMode.DECODE and batch.batch_size > 1:
            out = out[torch.tensor([1, 0, *range(2, batch.batch_size)])]
        return out


def test_shadow_mode_catches_a_backend_that_swaps_requests(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sprig.runtime.attention.cpu.TorchAttentionBackend", RowsSwapped)
    prompts, params = workload("a shared system prompt")
    with (
        Engine(str(tiny_llama), dtype="float32", shadow_attention=True) as engine,
        pytest.raises(ShadowMismatch, match=r"\(decode\), layer 0: the attention of requests \[0, 1\]"),
    ):
        engine.generate(prompts, params)


def test_shadow_mode_catches_stale_kept_kv(tiny_llama: Path) -> None:
    """The torch backend keeps gathered K/V across decode steps; if a slot it kept were
    rewritten without it being told (the invalidation it relies on), shadow mode fails at
    the next step."""
    config = ModelConfig.from_pretrained(tiny_llama)
    shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32)
    cache = KVCache(shape, POOL, device="cpu")
    for layer in range(config.num_layers):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    shadow = make_backend("torch", config, cache, shadow=True)
    c = [1]
    system = fresh(40, c)
    contexts = [system + fresh(n, c) for n in (3, 7, 5)]
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim

    def step() -> None:
        new = decode_step(contexts, set(), c)
        indptr, indices = build_batch(contexts)
        B = len(contexts)
        batch = ForwardBatch(
            ForwardMode.DECODE, torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
            torch.arange(B + 1, dtype=torch.int32), indptr, indices, torch.tensor(new), cache, 1, int(indptr.diff().max()),
        )
        shadow.begin_step(batch)
        shadow.forward(torch.randn(B, Hq, D) * 3, torch.randn(B, Hkv, D), torch.randn(B, Hkv, D), 0, batch, sm_scale=D**-0.5)

    step()
    step()
    cache.k[0][contexts[1][-2]] += 5.0  # an old slot rewritten behind the backend's back
    with pytest.raises(ShadowMismatch, match=r"layer 0: the attention of requests \[1\]"):
        step()
