"""Image blocks (Gemma 3's bidirectional attention among one image's tokens, given per new
token as `ForwardBatch.attend_until`) through the attention backends: the torch backend
(requests with image blocks alone on the per-request reference, the step's other requests
on their cascade paths: a shared prefix, short extends in padded buckets, prefills) and
the Triton backend (compiled on CUDA, in the interpreter on the CPU) equal the reference
backend layer by layer, over an extend step with images (at the start, in the middle and
at the end of prompts, one begun in the cached prefix, one wholly in it) and the decode
steps after it, with windows (shorter than every image, and one that bites nothing) and
soft caps; shadow mode passes them (the Triton backend runs inside it) and catches a
backend that ignores the images."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from attention_helpers import fresh, random_pools, step_batch

from sprig.radix.kv_cache import KVCache
from sprig.runtime.attention import backend_class, make_backend
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.attention.cpu.plan import widened_requests
from sprig.runtime.attention.shadow import ShadowAttention, ShadowMismatch
from sprig.runtime.attention.triton_backend import TritonAttentionBackend
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_config import ModelConfig

CPU = torch.device("cpu")
# (window, softcap) per layer: the plan's paths, capped; a window shorter than every image
# (the per-request reference for all); one longer than every context (the plan again)
LAYERS = ((None, None), (None, 5.0), (4, None), (1000, 2.0))
# each request's images, in context positions [start, end) (see `_extend`)
BLOCKS = [[(44, 50)], [], [], [(30, 39)], [], [], [(0, 8), (22, 30)], [], [(5, 15)]]
WIDENED = [True, False, False, True, False, False, True, False, False]  # a new token sees past itself


def _steps(decode_steps: int) -> list[tuple[ForwardMode, list[int], list[list[int]]]]:
    """(mode, new tokens per request, contexts) of each step: the extend step, then decode
    steps. Requests 0-2 share a 40-slot cached prefix, 0 with an image among its new
    tokens (1 and 2 stay a group); 3 and 4 share 36 cached slots, 3 with new tokens in an
    image begun in the cache (4, left alone, is a short extend, as 5 and 8 are: 8's image
    is wholly cached); 6 is a prefill opening and ending with an image, 7 one without."""
    c = [1]
    system, other = fresh(40, c), fresh(36, c)
    contexts = [
        system + fresh(12, c), system + fresh(3, c), system + fresh(14, c), other + fresh(6, c),
        other + fresh(5, c), fresh(24, c), fresh(30, c), fresh(20, c), fresh(25, c),
    ]
    steps = [(ForwardMode.EXTEND, [10, 3, 14, 6, 5, 4, 30, 20, 3], [list(ctx) for ctx in contexts])]
    for _ in range(decode_steps):
        for ctx in contexts:
            ctx += fresh(1, c)
        steps.append((ForwardMode.DECODE, [1] * len(contexts), [list(ctx) for ctx in contexts]))
    return steps


def with_images(batch: ForwardBatch, blocks: list[list[tuple[int, int]]]) -> ForwardBatch:
    """`batch` with each new token's attend_until: the end of the image holding it, else
    its position + 1."""
    qo, kv = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
    parts = []
    for b, spans in enumerate(blocks):
        n, L = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        pos = torch.arange(L - n, L)  # [n]
        until = pos + 1
        for start, end in spans:
            until[(pos >= start) & (pos < end)] = end
        parts.append(until)
    return dataclasses.replace(batch, attend_until=torch.cat(parts).to(batch.qo_indptr.device))


def step_batches(decode_steps: int, pool: KVCache) -> list[ForwardBatch]:
    """The steps' batches over `pool`, the extend step's with its images."""
    batches = [step_batch(mode, q_lens, contexts, pool) for mode, q_lens, contexts in _steps(decode_steps)]
    return [with_images(batches[0], BLOCKS), *batches[1:]]


def _qkv(
    batch: ForwardBatch, config: ModelConfig, g: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
    """Sharp queries (a mask that lets a token see more shows) and fresh K/V."""
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    q = (torch.randn(batch.num_tokens, Hq, D, generator=g) * 3).to(device)
    k, v = (torch.randn(batch.num_tokens, Hkv, D, generator=g).to(device) for _ in range(2))
    return q, k, v


def compare_with_reference(name: str, config: ModelConfig, storage: torch.dtype | None, decode_steps: int,
                           device: torch.device, shadow: bool = False) -> object:
    """Run the steps through backend `name` and the reference backend, each on its own copy
    of the pool, with the same q/k/v: every layer's output agrees, the pools stay bit-equal.
    With `shadow`, backend `name` runs in shadow mode, which passes every layer. Returns the
    backend."""
    mine, ref_pool = random_pools(config, len(LAYERS), 2, storage, device)
    runner = make_backend(name, config, mine, shadow=shadow)
    backend = runner.backend if shadow else runner
    reference = backend_class("reference")(config, ref_pool)
    g = torch.Generator().manual_seed(3)
    for batch in step_batches(decode_steps, mine):
        ref_batch = dataclasses.replace(batch, kv_cache=ref_pool)
        runner.begin_step(batch)
        reference.begin_step(ref_batch)
        for layer, (window, cap) in enumerate(LAYERS):
            q, k, v = _qkv(batch, config, g, device)
            got = runner.forward(q, k, v, layer, batch, sm_scale=0.25, window=window, softcap=cap).clone()
            want = reference.forward(q, k, v, layer, ref_batch, sm_scale=0.25, window=window, softcap=cap)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, w=window, c=cap, s=batch.mode: f"{s} window {w} softcap {c}: {m}")
            for buf in ("k", "v", "k_scale", "v_scale"):
                for a, b in zip(getattr(mine, buf), getattr(ref_pool, buf), strict=True):
                    assert torch.equal(a, b)
    if shadow:
        assert runner.checked == runner.steps * len(LAYERS)
    return backend


def test_the_requests_with_images_are_found(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, 1, 1, None, CPU)
    batch = step_batches(0, pool)[0]
    assert widened_requests(batch.qo_indptr, batch.kv_indptr, batch.attend_until).tolist() == WIDENED
    plain = dataclasses.replace(batch, attend_until=batch.positions + 1)
    assert not bool(widened_requests(plain.qo_indptr, plain.kv_indptr, plain.attend_until).any())


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_torch_backend_equals_the_reference(tiny_llama: Path, storage: torch.dtype | None) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    backend = compare_with_reference("torch", config, storage, decode_steps=3, device=CPU)
    assert isinstance(backend, TorchAttentionBackend)


def test_torch_backend_keeps_its_paths_for_the_requests_without_images(tiny_llama: Path) -> None:
    """Only the requests with images leave the plan: 1 and 2 still share their prefix."""
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, 1, 1, None, CPU)
    backend = TorchAttentionBackend(config, pool)
    batch = step_batches(0, pool)[0]
    backend.begin_step(batch)
    plan = backend._step.plan
    assert plan.alone == {b for b, wide in enumerate(WIDENED) if wide}
    assert [g.members.tolist() for g in plan.groups] == [[1, 2]]
    backend.begin_step(dataclasses.replace(batch, attend_until=batch.positions + 1))
    assert backend._step.plan.alone == frozenset()
    assert [g.members.tolist() for g in backend._step.plan.groups] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (4, 2.0), (1000, None)])
def test_torch_backend_widens_exactly_the_image_tokens(tiny_llama: Path, window: int | None,
                                                       softcap: float | None) -> None:
    """Against the same layer without images: the outputs differ exactly for the tokens
    whose image goes on after them (attend_until is applied, not dropped on the way)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, 1, 1, None, CPU)
    backend = TorchAttentionBackend(config, pool)
    batch = step_batches(0, pool)[0]
    plain = dataclasses.replace(batch, attend_until=None)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(5), CPU)
    backend.begin_step(plain)
    causal = backend.forward(q, k, v, 0, plain, sm_scale=0.25, window=window, softcap=softcap)
    backend.begin_step(batch)
    got = backend.forward(q, k, v, 0, batch, sm_scale=0.25, window=window, softcap=softcap)
    assert (got - causal).abs().amax(dim=(1, 2)).gt(1e-3).equal(batch.attend_until > batch.positions + 1)


def test_triton_backend_equals_the_reference(tiny_llama: Path) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    backend = compare_with_reference("triton", ModelConfig.from_pretrained(tiny_llama), None, decode_steps=1,
                                     device=device, shadow=True)
    assert isinstance(backend, TritonAttentionBackend)


def test_shadow_mode_passes_image_blocks(tiny_llama: Path) -> None:
    """The torch backend in shadow mode (the Triton one: test_triton_backend_equals_the_reference)."""
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, len(LAYERS), 1, None, CPU)
    shadow = make_backend("torch", config, pool, shadow=True)
    assert isinstance(shadow, ShadowAttention)
    g = torch.Generator().manual_seed(7)
    for batch in step_batches(2, pool):
        shadow.begin_step(batch)
        for layer, (window, cap) in enumerate(LAYERS):
            shadow.forward(*_qkv(batch, config, g, CPU), layer, batch, sm_scale=0.25, window=window, softcap=cap)
    assert shadow.checked == shadow.steps * len(LAYERS)


class ImagesIgnored(TorchAttentionBackend):
    """A broken backend: it attends causally, whatever the batch's attend_until."""

    def begin_step(self, batch: ForwardBatch) -> None:
        self.plain = dataclasses.replace(batch, attend_until=None)
        super().begin_step(self.plain)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, **kwargs: object,
    ) -> torch.Tensor:
        return super().forward(q, k, v, layer, self.plain, **kwargs)


def test_shadow_mode_catches_a_backend_that_ignores_the_images(tiny_llama: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama)
    (pool,) = random_pools(config, len(LAYERS), 1, None, CPU)
    shadow = ShadowAttention(ImagesIgnored(config, pool), backend_class("reference")(config, pool))
    batch = step_batches(0, pool)[0]
    shadow.begin_step(batch)
    q, k, v = _qkv(batch, config, torch.Generator().manual_seed(2), CPU)
    with pytest.raises(ShadowMismatch, match=r"\(extend\), layer 0: the attention of requests \[0, 3, 6\]"):
        shadow.forward(q, k, v, 0, batch, sm_scale=0.25)
