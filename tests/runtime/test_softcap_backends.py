"""Soft-capped layers (Gemma 2's attention-logit cap) through the attention backends: the
torch backend (cascade plans: shared prefixes merged by log-sum-exp, padded remainder
buckets, short extends, the per-request reference for prefills; K/V kept across decode
steps) and the Triton backend (compiled on CUDA, in the interpreter on the CPU) equal the
reference backend layer by layer, over an extend step with cached shared prefixes and
decode steps whose contexts grow (some past the windows) while a request leaves; shadow
mode passes them (the Triton backend runs inside it) and catches a backend that drops the
cap."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from attention_helpers import random_pools, shared_prefix_steps, step_batch

from sprig.runtime.attention import backend_class, make_backend
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.attention.shadow import ShadowAttention, ShadowMismatch
from sprig.runtime.attention.triton_backend import TritonAttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.model_config import ModelConfig

CPU = torch.device("cpu")
POOL = 512
# (window, softcap) per layer: capped layers beside an uncapped one, with and without
# windows (8 bites from the extend step on, 58 only from the fifth decode step)
LAYERS = ((None, None), (None, 50.0), (None, 1.0), (8, 5.0), (58, 2.0))




def _qkv(batch: ForwardBatch, config: ModelConfig, g: torch.Generator, device: torch.device):
    """Sharp queries (scores of several units: every cap but 50 bites) and fresh K/V."""
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    q = (torch.randn(batch.num_tokens, Hq, D, generator=g) * 3).to(device)
    k, v = (torch.randn(batch.num_tokens, Hkv, D, generator=g).to(device) for _ in range(2))
    return q, k, v


def compare_with_reference(name: str, config: ModelConfig, storage: torch.dtype | None, decode_steps: int,
                           device: torch.device, num_sms: int | None = None, shadow: bool = False) -> object:
    """Run the steps through backend `name` and the reference backend, each on its own
    copy of the pool, with the same q/k/v: every layer's output agrees, and a capped
    layer's differs from what the same layer gives uncapped. With `shadow`, backend `name`
    runs in shadow mode, which passes every layer. Returns the backend."""
    mine, ref_pool = random_pools(config, len(LAYERS), 2, storage, device)
    runner = make_backend(name, config, mine, shadow=shadow)
    backend = runner.backend if shadow else runner
    if num_sms is not None:
        backend.num_sms = num_sms  # as a GPU's: decode contexts are split, and stage 2 merges
    reference = backend_class("reference")(config, ref_pool)
    g = torch.Generator().manual_seed(3)
    scale = config.head_dim**-0.5
    for mode, q_lens, contexts in shared_prefix_steps(decode_steps):
        batch = step_batch(mode, q_lens, contexts, mine)
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        runner.begin_step(batch)
        reference.begin_step(ref_batch)
        for layer, (window, cap) in enumerate(LAYERS):
            q, k, v = _qkv(batch, config, g, device)
            got = runner.forward(q, k, v, layer, batch, sm_scale=scale, window=window, softcap=cap).clone()
            want = reference.forward(q, k, v, layer, ref_batch, sm_scale=scale, window=window, softcap=cap)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, c=cap, s=mode: f"{s} softcap {c}: {m}")
            if cap is not None and cap < 10:
                uncapped = reference.forward(q, k, v, layer, ref_batch, sm_scale=scale, window=window)
                assert float((got - uncapped).abs().max()) > 0.1
    if shadow:
        assert runner.checked == runner.steps * len(LAYERS)
    return backend


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_torch_backend_equals_the_reference(tiny_llama: Path, storage: torch.dtype | None) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    backend = compare_with_reference("torch", config, storage, decode_steps=8, device=CPU)
    assert isinstance(backend, TorchAttentionBackend)
    # the capped layers decoded through the kept stores, a shared prefix and remainders,
    # but the one whose window of 8 cuts the prefix and slides every step
    kept = {1, 2, 4}
    assert kept <= {key[0] for key in backend.kept_kv.prefixes._entries}
    assert kept <= {key[0] for key in backend.kept_kv.tails._entries}


def test_triton_backend_equals_the_reference(tiny_llama: Path) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    backend = compare_with_reference("triton", ModelConfig.from_pretrained(tiny_llama), None, decode_steps=1,
                                     device=device, num_sms=16, shadow=True)
    assert isinstance(backend, TritonAttentionBackend)


@pytest.mark.parametrize("name", ["torch", "reference", "triton"])
def test_backends_refuse_a_cap_that_is_not_positive(tiny_llama: Path, name: str) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    device = torch.device("cuda") if name == "triton" and torch.cuda.is_available() else CPU
    (pool,) = random_pools(config, len(LAYERS), 1, None, device)
    backend = backend_class(name)(config, pool)
    mode, q_lens, contexts = shared_prefix_steps(0)[0]
    batch = step_batch(mode, q_lens, contexts, pool)
    backend.begin_step(batch)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(0), device)
    with pytest.raises(ValueError, match="softcap is a finite number > 0"):
        backend.forward(q, k, v, 0, batch, sm_scale=0.25, softcap=0.0)


def test_shadow_mode_passes_capped_layers(tiny_llama: Path) -> None:
    """The torch backend in shadow mode (the Triton one: test_triton_backend_equals_the_reference)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, len(LAYERS), 1, None, CPU)
    shadow = make_backend("torch", config, pool, shadow=True)
    assert isinstance(shadow, ShadowAttention)
    g = torch.Generator().manual_seed(7)
    for mode, q_lens, contexts in shared_prefix_steps(4):
        batch = step_batch(mode, q_lens, contexts, pool)
        shadow.begin_step(batch)
        for layer, (window, cap) in enumerate(LAYERS):
            shadow.forward(*_qkv(batch, config, g, CPU), layer, batch, sm_scale=0.25, window=window, softcap=cap)
    assert shadow.checked == shadow.steps * len(LAYERS)


class CapDropped(TorchAttentionBackend):
    """A broken backend: it attends without the layer's cap."""

    def forward(self, q, k, v, layer, batch, *, sm_scale, window=None, softcap=None, sinks=None):
        return super().forward(q, k, v, layer, batch, sm_scale=sm_scale, window=window, sinks=sinks)


def test_shadow_mode_catches_a_backend_that_drops_the_cap(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, len(LAYERS), 1, None, CPU)
    shadow = ShadowAttention(CapDropped(config, pool), backend_class("reference")(config, pool))
    mode, q_lens, contexts = shared_prefix_steps(0)[0]
    batch = step_batch(mode, q_lens, contexts, pool)
    shadow.begin_step(batch)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(2), CPU)
    shadow.forward(q, k, v, 0, batch, sm_scale=0.25)  # uncapped: nothing to drop
    with pytest.raises(ShadowMismatch, match=r"\(extend\), layer 2"):
        shadow.forward(q, k, v, 2, batch, sm_scale=0.25, softcap=1.0)
