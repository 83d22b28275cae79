"""Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's
denominator and weighs no value) through the attention backends: the reference backend
against a float64 definition; the torch backend (cascade plans: shared prefixes merged by
log-sum-exp, padded remainder buckets, short extends, the per-request reference for
prefills and for requests with image blocks; K/V kept across decode steps) and the
Triton backend (compiled on CUDA, in the interpreter on the CPU; decode split across
several programs) against the reference backend layer by layer, over an extend step with
cached shared prefixes and decode steps whose contexts grow (some past the windows) while
a request leaves; sinks beside windows, soft caps, int8 pools and layers without sinks.
Shadow mode passes them (the Triton backend runs inside it) and catches a backend that
drops the sinks or adds one twice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from attention_helpers import random_pools, shared_prefix_steps, step_batch
from test_image_block_backends import step_batches as image_step_batches

from sprig.radix.kv_cache import KVCache
from sprig.runtime.attention import backend_class, make_backend
from sprig.runtime.attention.cpu import TorchAttentionBackend, cascade
from sprig.runtime.attention.shadow import ShadowAttention, ShadowMismatch
from sprig.runtime.attention.triton_backend import TritonAttentionBackend
from sprig.runtime.forward_batch import ForwardBatch
from sprig.runtime.model_config import ModelConfig

CPU = torch.device("cpu")
# per head, cycled: most of the mass to the sink; none; a little; about half
MIXED = (20.0, -20.0, 0.5, 4.0)
# (window, softcap, sinks) per layer: a layer without sinks beside layers with them, capped
# or not, with windows (8 bites from the extend step on, 58 only from the fifth decode step)
LAYERS = (
    (None, None, None),
    (None, None, MIXED),
    (None, 5.0, MIXED),
    (8, None, (20.0,)),
    (58, 2.0, (-20.0, 6.0)),  # the capped log-sum-exps lie below 2 + log(58), about 6
)
Layer = tuple[int | None, float | None, tuple[float, ...] | None]


def layer_sinks(values: tuple[float, ...] | None, heads: int, device: torch.device) -> torch.Tensor | None:
    """[heads] float32: `values` cycled over the query heads (None: a layer without sinks)."""
    if values is None:
        return None
    return torch.tensor([values[h % len(values)] for h in range(heads)], dtype=torch.float32, device=device)


def step_batches(decode_steps: int, pool: KVCache) -> list[ForwardBatch]:
    return [step_batch(mode, q_lens, contexts, pool) for mode, q_lens, contexts in shared_prefix_steps(decode_steps)]


def _qkv(
    batch: ForwardBatch, config: ModelConfig, g: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
    """Sharp queries (scores of several units, log-sum-exps near the moderate sinks) and
    fresh K/V."""
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    q = (torch.randn(batch.num_tokens, Hq, D, generator=g) * 3).to(device)
    k, v = (torch.randn(batch.num_tokens, Hkv, D, generator=g).to(device) for _ in range(2))
    return q, k, v


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """Each (token, head) row relative to its own size: a +20 sink shrinks rows to about
    e^-15, below any absolute tolerance."""
    size = want.abs().amax(dim=-1, keepdim=True).double().clamp_min(1e-30)
    torch.testing.assert_close(got.double() / size, want.double() / size, atol=2e-5, rtol=1e-5,
                               msg=lambda m: f"{msg}: {m}")


def compare_with_reference(name: str, config: ModelConfig, storage: torch.dtype | None,
                           batches: list[ForwardBatch], layers: tuple[Layer, ...], device: torch.device,
                           num_sms: int | None = None, shadow: bool = False) -> object:
    """Run `batches` (over a pool `random_pools` made) through backend `name` and the
    reference backend, each on its own copy of the pool, with the same q/k/v: every
    layer's output agrees, and a layer with sinks differs from the same layer without.
    With `shadow`, backend `name` runs in shadow mode, which passes every layer. Returns
    the backend."""
    mine = batches[0].kv_cache
    (ref_pool,) = random_pools(config, len(layers), 1, storage, device)
    runner = make_backend(name, config, mine, shadow=shadow)
    backend = runner.backend if shadow else runner
    if num_sms is not None:
        backend.num_sms = num_sms  # as a GPU's: decode contexts are split, and stage 2 merges
    reference = backend_class("reference")(config, ref_pool)
    g = torch.Generator().manual_seed(3)
    for batch in batches:
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        runner.begin_step(batch)
        reference.begin_step(ref_batch)
        for layer, (window, cap, values) in enumerate(layers):
            q, k, v = _qkv(batch, config, g, device)
            kw = {"sm_scale": config.head_dim**-0.5, "window": window, "softcap": cap}
            sinks = layer_sinks(values, config.num_heads, device)
            got = runner.forward(q, k, v, layer, batch, **kw, sinks=sinks).clone()
            want = reference.forward(q, k, v, layer, ref_batch, **kw, sinks=sinks)
            assert_rows_close(got, want, f"{batch.mode} layer {layer}")
            if values is not None:
                plain = reference.forward(q, k, v, layer, ref_batch, **kw)
                assert float((got - plain).abs().max()) > 0.1
    if shadow:
        assert runner.checked == runner.steps * len(layers)
    return backend


def _pools(config: ModelConfig, storage: torch.dtype | None, device: torch.device) -> KVCache:
    (pool,) = random_pools(config, len(LAYERS), 1, storage, device)
    return pool


def test_reference_backend_matches_the_definition(tiny_llama: Path) -> None:
    """The reference backend against float64 attention written out from the pool: scores,
    the causal mask, one more column holding the head's sink, softmax, that column
    dropped; for the extend step and a decode step."""
    config = ModelConfig.from_pretrained(tiny_llama)
    pool = _pools(config, None, CPU)
    backend = backend_class("reference")(config, pool)
    sinks = layer_sinks(MIXED, config.num_heads, CPU)
    g = torch.Generator().manual_seed(4)
    G = config.num_heads // config.num_kv_heads
    for batch in step_batches(1, pool):
        backend.begin_step(batch)
        q, k, v = _qkv(batch, config, g, CPU)
        got = backend.forward(q, k, v, 1, batch, sm_scale=0.25, sinks=sinks)
        qo, kv = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
        for b in range(batch.batch_size):
            n, L = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
            slots = batch.kv_indices[kv[b] : kv[b + 1]].long()
            keys = pool.k[1][slots].double().repeat_interleave(G, dim=1)  # [L, Hq, D]
            values = pool.v[1][slots].double().repeat_interleave(G, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", q[qo[b] : qo[b + 1]].double(), keys) * 0.25
            seen = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]  # [n, L]
            scores = torch.cat([scores.masked_fill(~seen, float("-inf")),
                                sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
            want = torch.einsum("hnl,lhd->nhd", scores.softmax(-1)[..., :L], values)
            assert_rows_close(got[qo[b] : qo[b + 1]], want, f"{batch.mode} request {b}")


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_torch_backend_equals_the_reference(tiny_llama: Path, storage: torch.dtype | None) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    batches = step_batches(8, _pools(config, storage, CPU))
    backend = compare_with_reference("torch", config, storage, batches, LAYERS, CPU)
    assert isinstance(backend, TorchAttentionBackend)
    # the layers with sinks decoded through a shared prefix and remainders, their K/V kept,
    # but the one whose window of 8 cuts the prefix and slides every step
    assert [g.members.tolist() for g in backend._step.plan.sharing.groups] == [[0, 1]]  # 1 left
    kept = {1, 2, 4}
    assert kept <= {key[0] for key in backend.kept_kv.prefixes._entries}
    assert kept <= {key[0] for key in backend.kept_kv.tails._entries}


def test_torch_backend_with_image_blocks_equals_the_reference(tiny_llama: Path) -> None:
    """Requests with image blocks run the per-request reference (its own sink), the
    step's others the cascade paths (the sink joined after the merge)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    layers = ((None, None, MIXED), (4, 2.0, MIXED), (1000, None, (20.0,)))
    (pool,) = random_pools(config, len(layers), 1, None, CPU)
    batches = image_step_batches(2, pool)
    backend = compare_with_reference("torch", config, None, batches, layers, CPU)
    backend.begin_step(batches[0])
    plan = backend._step.plan
    assert plan.alone and plan.groups


def test_triton_backend_equals_the_reference(tiny_llama: Path) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    config = ModelConfig.from_pretrained(tiny_llama)
    batches = step_batches(1, _pools(config, None, device))
    backend = compare_with_reference("triton", config, None, batches, LAYERS, device, num_sms=16, shadow=True)
    assert isinstance(backend, TritonAttentionBackend)


@pytest.mark.parametrize("name", ["torch", "reference", "triton"])
def test_backends_refuse_sinks_of_the_wrong_shape(tiny_llama: Path, name: str) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    device = torch.device("cuda") if name == "triton" and torch.cuda.is_available() else CPU
    pool = _pools(config, None, device)
    backend = backend_class(name)(config, pool)
    batch = step_batches(0, pool)[0]
    backend.begin_step(batch)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(0), device)
    per_kv_head = torch.zeros(config.num_kv_heads, device=device)
    with pytest.raises(ValueError, match="attention sinks are one float32 entry per query head"):
        backend.forward(q, k, v, 0, batch, sm_scale=0.25, sinks=per_kv_head)


def test_shadow_mode_passes_layers_with_sinks(tiny_llama: Path) -> None:
    """The torch backend in shadow mode (the Triton one: test_triton_backend_equals_the_reference)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    pool = _pools(config, None, CPU)
    shadow = make_backend("torch", config, pool, shadow=True)
    assert isinstance(shadow, ShadowAttention)
    g = torch.Generator().manual_seed(7)
    for batch in step_batches(4, pool):
        shadow.begin_step(batch)
        for layer, (window, cap, values) in enumerate(LAYERS):
            shadow.forward(*_qkv(batch, config, g, CPU), layer, batch, sm_scale=0.25, window=window, softcap=cap,
                           sinks=layer_sinks(values, config.num_heads, CPU))
    assert shadow.checked == shadow.steps * len(LAYERS)


class SinksDropped(TorchAttentionBackend):
    """A broken backend: it attends without the layer's sinks."""

    def forward(self, q, k, v, layer, batch, *, sm_scale, window=None, softcap=None, sinks=None):
        return super().forward(q, k, v, layer, batch, sm_scale=sm_scale, window=window, softcap=softcap)


def test_shadow_mode_catches_a_backend_that_drops_the_sinks(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    pool = _pools(config, None, CPU)
    shadow = ShadowAttention(SinksDropped(config, pool), backend_class("reference")(config, pool))
    batch = step_batches(0, pool)[0]
    shadow.begin_step(batch)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(2), CPU)
    shadow.forward(q, k, v, 0, batch, sm_scale=0.25)  # no sinks: nothing to drop
    with pytest.raises(ShadowMismatch, match=r"\(extend\), layer 1"):
        shadow.forward(q, k, v, 1, batch, sm_scale=0.25, sinks=layer_sinks(MIXED, config.num_heads, CPU))


def test_shadow_mode_catches_sinks_added_twice_in_the_cascade(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cascade that gives the grouped decode rows their sink a second time: the shared
    prefix's rows differ from the reference; a layer without sinks still passes."""
    real = cascade.add_sinks_

    def twice(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return real(real(out, lse, sinks), lse, sinks)

    monkeypatch.setattr(cascade, "add_sinks_", twice)
    config = ModelConfig.from_pretrained(tiny_llama)
    pool = _pools(config, None, CPU)
    shadow = make_backend("torch", config, pool, shadow=True)
    g = torch.Generator().manual_seed(5)
    extend, decode = step_batches(1, pool)
    for batch in (extend, decode):
        shadow.begin_step(batch)
        shadow.forward(*_qkv(batch, config, g, CPU), 0, batch, sm_scale=0.25)
    with pytest.raises(ShadowMismatch, match=r"\(decode\), layer 1: the attention of requests \[0, 1, 2"):
        shadow.forward(*_qkv(decode, config, g, CPU), 1, decode, sm_scale=0.25,
                       sinks=layer_sinks((4.0,), config.num_heads, CPU))
