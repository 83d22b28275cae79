"""Sliding-window layers through the attention backends: the torch backend (cascade plans
over contexts cut to the window, K/V kept across decode steps) and the Triton backend
(compiled on CUDA, in the interpreter on the CPU) equal the reference backend layer by
layer, through an extend step over cached prefixes and decode steps whose contexts grow
past the windows (the cut contexts slide a slot a step) while requests share a prefix and
leave; and shadow mode passes them (the Triton backend runs inside it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from attention_helpers import fresh, random_pools, step_batch

from sprig.runtime.attention import backend_class, make_backend
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.attention.cpu.plan import trim_to_window
from sprig.runtime.attention.shadow import ShadowAttention
from sprig.runtime.attention.triton_backend import TritonAttentionBackend
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.model_config import ModelConfig

CPU = torch.device("cpu")
POOL = 512
# one window per layer: full attention beside windowed layers, as Mistral and Gemma mix
# them; 50 and 60 first bite in the extend step and in the decode steps respectively
LAYER_WINDOWS = (None, 8, 50, 60, 1)



def _steps(decode_steps: int) -> list[tuple[ForwardMode, list[int], list[list[int]]]]:
    """(mode, new tokens per request, contexts) of each step: an extend step, then decode
    steps. Three requests share a 40-slot cached prefix (one of them with 4 more of its
    own cached), one has nothing cached, and one is a 150-token prefill (the torch
    backend takes its windowed queries in blocks); the second leaves after the fourth
    decode step."""
    c = [1]
    system = fresh(40, c)
    contexts = [system + fresh(6, c), system + fresh(3, c), system + fresh(14, c), fresh(30, c), fresh(150, c)]
    steps = [(ForwardMode.EXTEND, [6, 3, 10, 30, 150], [list(ctx) for ctx in contexts])]
    for step in range(decode_steps):
        if step == 4:
            del contexts[1]
        for ctx in contexts:
            ctx += fresh(1, c)
        steps.append((ForwardMode.DECODE, [1] * len(contexts), [list(ctx) for ctx in contexts]))
    return steps



def compare_with_reference(name: str, config: ModelConfig, storage: torch.dtype | None, decode_steps: int,
                           device: torch.device, num_sms: int | None = None, shadow: bool = False) -> object:
    """Run the steps through backend `name` and the reference backend, each on its own copy
    of the pool, with the same q/k/v: every layer's output agrees, the pools stay bit-equal.
    With `shadow`, backend `name` runs in shadow mode, which passes every layer. Returns the
    backend."""
    mine, ref_pool = random_pools(config, len(LAYER_WINDOWS), 2, storage, device)
    runner = make_backend(name, config, mine, shadow=shadow)
    backend = runner.backend if shadow else runner
    if num_sms is not None:
        backend.num_sms = num_sms  # as a GPU's: decode contexts are split, and stage 2 merges
    reference = backend_class("reference")(config, ref_pool)
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    for mode, q_lens, contexts in _steps(decode_steps):
        batch = step_batch(mode, q_lens, contexts, mine)
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        runner.begin_step(batch)
        reference.begin_step(ref_batch)
        for layer, window in enumerate(LAYER_WINDOWS):
            q = (torch.randn(batch.num_tokens, Hq, D, generator=g) * 3).to(device)  # sharp: mix-ups show
            k, v = (torch.randn(batch.num_tokens, Hkv, D, generator=g).to(device) for _ in range(2))
            got = runner.forward(q, k, v, layer, batch, sm_scale=D**-0.5, window=window)
            want = reference.forward(q, k, v, layer, ref_batch, sm_scale=D**-0.5, window=window)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=lambda m, w=window, s=mode: f"{s} window {w}: {m}")
            for buf in ("k", "v", "k_scale", "v_scale"):
                for a, b in zip(getattr(mine, buf), getattr(ref_pool, buf), strict=True):
                    assert torch.equal(a, b)
    if shadow:
        assert runner.checked == runner.steps * len(LAYER_WINDOWS)
    return backend


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_torch_backend_equals_the_reference(tiny_llama: Path, storage: torch.dtype | None) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    backend = compare_with_reference("torch", config, storage, decode_steps=8, device=CPU)
    assert isinstance(backend, TorchAttentionBackend)
    # remainders are kept by the full layer and by windowed layers with contexts still
    # shorter than the window; those of windows 8 and 1 slide every step: never kept
    assert {key[2:] for key in backend.kept_kv.tails._entries} == {(), (50,), (60,)}
    assert any(len(key) == 3 for key in backend.kept_kv.prefixes._entries)  # a windowed layer's group too


def test_triton_backend_equals_the_reference(tiny_llama: Path) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    backend = compare_with_reference("triton", ModelConfig.from_pretrained(tiny_llama), None, decode_steps=1,
                                     device=device, num_sms=16, shadow=True)
    assert isinstance(backend, TritonAttentionBackend)


def test_windowed_layers_attend_within_the_window(tiny_llama: Path) -> None:
    """The torch backend with a window equals the reference, and differs from full
    attention exactly for the tokens the window hides a position from: the window is
    applied, not dropped on the way."""
    config = ModelConfig.from_pretrained(tiny_llama)
    pool, ref_pool = random_pools(config, len(LAYER_WINDOWS), 2, None, CPU)
    backend = TorchAttentionBackend(config, pool)
    reference = backend_class("reference")(config, ref_pool)
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    g = torch.Generator().manual_seed(5)
    for mode, q_lens, contexts in _steps(2):
        batch = step_batch(mode, q_lens, contexts, pool)
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        backend.begin_step(batch)
        reference.begin_step(ref_batch)
        q = torch.randn(batch.num_tokens, Hq, D, generator=g) * 3
        k, v = torch.randn(batch.num_tokens, Hkv, D, generator=g), torch.randn(batch.num_tokens, Hkv, D, generator=g)
        full = reference.forward(q, k, v, 1, ref_batch, sm_scale=0.25).clone()
        got = backend.forward(q, k, v, 1, batch, sm_scale=0.25, window=8)
        torch.testing.assert_close(got, reference.forward(q, k, v, 1, ref_batch, sm_scale=0.25, window=8),
                                   atol=2e-5, rtol=1e-5)
        hidden = batch.positions >= 8  # [T]: tokens the window hides a position from
        assert bool(hidden.any())
        assert (got - full).abs().amax(dim=(1, 2)).gt(1e-3).equal(hidden)


def test_cut_contexts_are_each_contexts_last_slots() -> None:
    indptr = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    indices = torch.arange(100, 111, dtype=torch.int32)
    cut_indptr, cut_indices = trim_to_window(indptr, indices, 4)
    assert cut_indptr.tolist() == [0, 3, 3, 7, 8]
    assert cut_indices.tolist() == [100, 101, 102, 106, 107, 108, 109, 110]


def test_shadow_mode_passes_windowed_layers(tiny_llama: Path) -> None:
    """The torch backend in shadow mode (the Triton one: test_triton_backend_equals_the_reference)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, len(LAYER_WINDOWS), 1, None, CPU)
    shadow = make_backend("torch", config, pool, shadow=True)
    assert isinstance(shadow, ShadowAttention)
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    g = torch.Generator().manual_seed(7)
    for mode, q_lens, contexts in _steps(6):
        batch = step_batch(mode, q_lens, contexts, pool)
        shadow.begin_step(batch)
        for layer, window in enumerate(LAYER_WINDOWS):
            q = torch.randn(batch.num_tokens, Hq, D, generator=g) * 3
            k, v = (torch.randn(batch.num_tokens, Hkv, D, generator=g) for _ in range(2))
            shadow.forward(q, k, v, layer, batch, sm_scale=0.25, window=window)
    assert shadow.checked == shadow.steps * len(LAYER_WINDOWS)
