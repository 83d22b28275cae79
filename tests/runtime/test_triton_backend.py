"""The Triton attention backend: the model runner through it against Hugging Face
transformers (prefill logits, greedy decoding), and the backend against the torch
reference backend on the same `ForwardBatch`. Without CUDA the kernels run in Triton's
CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay tiny."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import contexts_step
from transformers import AutoModelForCausalLM

from sprig.radix.kv_cache import KVCache, KVShape
from sprig.runtime.attention.cpu import TorchAttentionBackend
from sprig.runtime.attention.triton_backend import TritonAttentionBackend
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import build_forward_batch
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LENS = (7, 1, 13, 5)
DECODE_TOKENS = 4  # greedy tokens compared with HF generate: one from prefill, three decodes
ATOL = 1e-4  # runner vs HF logits
KERNEL_TOL = {"atol": 2e-5, "rtol": 1e-5}  # triton vs torch backend, float32


@pytest.fixture(scope="module", autouse=True)
def _triton_ready() -> None:
    if DEVICE == "cpu":
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(standard.sum, InterpretedFunction), (
            "triton was imported before TRITON_INTERPRET=1 was set"
        )


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GQA 4:2 (the tiny llama) and MQA 4:1 (sharp attention, so head mix-ups show)."""
    mqa = build_tiny_checkpoint(
        tmp_path_factory.mktemp("triton") / "llama-mqa", "llama", seed=1,
        num_key_value_heads=1, initializer_range=0.2,
    )
    return {"llama-gqa": tiny_llama, "llama-mqa": mqa}


class ScatteredSlots:
    """Distinct pool slots in a random order, so contexts are not contiguous in the pool."""

    def __init__(self, cache: KVCache, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(cache.num_slots, generator=g) + cache.page_size).to(torch.int32)
        self.next = 0

    def take(self, n: int) -> torch.Tensor:  # [n] int32
        slots = self.free[self.next : self.next + n]
        self.next += n
        return slots


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa"])
def test_runner_matches_hf(name: str, checkpoints: dict[str, Path]) -> None:
    """One batch of odd-length prompts: prefill logits of every position within ATOL of
    HF, then greedy decode steps give HF generate's tokens."""
    path = checkpoints[name]
    runner = ModelRunner(RunnerConfig(
        path, dtype="float32", device=DEVICE, attention_backend="triton", max_total_tokens=128,
    ))
    assert isinstance(runner.backend, TritonAttentionBackend)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    slots = ScatteredSlots(runner.kv_cache)
    contexts = [slots.take(n) for n in PROMPT_LENS]

    logits = runner.forward(contexts_step(
        ForwardMode.EXTEND, [t for p in prompts for t in p], list(PROMPT_LENS), contexts,
        [0] * len(prompts),
    )).cpu()  # [sum(PROMPT_LENS), V]
    for got, ids in zip(logits.split(PROMPT_LENS), prompts, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()  # [len, V]
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    next_ids = [int(rows[-1].argmax()) for rows in logits.split(PROMPT_LENS)]
    outputs = [[t] for t in next_ids]
    for _ in range(DECODE_TOKENS - 1):
        contexts = [torch.cat([c, slots.take(1)]) for c in contexts]
        step = contexts_step(ForwardMode.DECODE, next_ids, [1] * len(prompts), contexts, [0] * len(prompts))
        next_ids = runner.forward(step).argmax(-1).tolist()
        for out, tok in zip(outputs, next_ids, strict=True):
            out.append(tok)

    for ids, got in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=DECODE_TOKENS, do_sample=False,
                pad_token_id=hf.config.eos_token_id,
            )[0, len(ids) :].tolist()
        assert got[: len(ref)] == ref  # HF stops early only at an eos


def _pools(config: ModelConfig) -> tuple[KVCache, KVCache]:
    """Two equal float32 pools (one per backend) filled with random K/V: the prefixes."""
    shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32)
    a, b = KVCache(shape, 256, device=DEVICE), KVCache(shape, 256, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    for layer in range(config.num_layers):
        for buf in ("k", "v"):
            init = torch.randn(getattr(a, buf)[layer].shape, generator=g)
            getattr(a, buf)[layer].copy_(init)
            getattr(b, buf)[layer].copy_(init)
    return a, b


# mode -> (cached prefix lengths, new tokens per request); 3 + 67 new tokens span two
# query blocks of the extend kernel; decode contexts up to 70 span two KV blocks
BATCHES = {
    "extend-with-prefix": (ForwardMode.EXTEND, [5, 0, 9, 3], [3, 1, 67, 2]),
    "decode": (ForwardMode.DECODE, [0, 5, 69, 12], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", list(BATCHES))
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa"])
def test_matches_torch_backend(name: str, case: str, checkpoints: dict[str, Path]) -> None:
    """Same ForwardBatch (over scattered slots), same q/k/v, every layer: the Triton
    backend's output and stored K/V equal the torch reference backend's."""
    config = ModelConfig.from_pretrained(checkpoints[name])
    mode, prefix_lens, q_lens = BATCHES[case]
    pool_tri, pool_ref = _pools(config)
    slots = ScatteredSlots(pool_tri, seed=2)
    contexts = [slots.take(p + n) for p, n in zip(prefix_lens, q_lens, strict=True)]
    step = contexts_step(mode, [0] * sum(q_lens), q_lens, contexts, [0] * len(q_lens))
    batch, _ = build_forward_batch(step, pool_tri, torch.device(DEVICE))
    batch_ref = dataclasses.replace(batch, kv_cache=pool_ref)  # same metadata tensors
    triton_backend = TritonAttentionBackend(config, pool_tri)
    triton_backend.num_sms = 16  # as a GPU's: decode splits each context (4 or 8 ways), which stage 2 merges
    torch_backend = TorchAttentionBackend(config, pool_ref)
    triton_backend.begin_step(batch)
    torch_backend.begin_step(batch_ref)

    g = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D = batch.num_tokens, config.num_heads, config.num_kv_heads, config.head_dim
    for layer in range(config.num_layers):
        q = torch.randn(T, Hq, D, generator=g).to(DEVICE)
        k = torch.randn(T, Hkv, D, generator=g).to(DEVICE)
        v = torch.randn(T, Hkv, D, generator=g).to(DEVICE)
        got = triton_backend.forward(q, k, v, layer, batch, sm_scale=D**-0.5)
        want = torch_backend.forward(q, k, v, layer, batch_ref, sm_scale=D**-0.5)
        torch.testing.assert_close(got, want, **KERNEL_TOL)
        assert torch.equal(pool_tri.k[layer], pool_ref.k[layer])
        assert torch.equal(pool_tri.v[layer], pool_ref.v[layer])


@pytest.mark.parametrize("backend_class", [TritonAttentionBackend, TorchAttentionBackend])
def test_forward_requires_begin_step(checkpoints: dict[str, Path], backend_class: type) -> None:
    config = ModelConfig.from_pretrained(checkpoints["llama-gqa"])
    pool, _ = _pools(config)
    backend = backend_class(config, pool)
    step = contexts_step(ForwardMode.DECODE, [0], [1], [torch.tensor([1, 2])], [0])
    batch, _ = build_forward_batch(step, pool, torch.device(DEVICE))
    q = torch.zeros(1, config.num_heads, config.head_dim, device=DEVICE)
    kv = torch.zeros(1, config.num_kv_heads, config.head_dim, device=DEVICE)
    before = pool.k[0].clone()
    with pytest.raises(RuntimeError, match="begin_step"):
        backend.forward(q, kv + 1, kv, 0, batch, sm_scale=1.0)
    backend.begin_step(dataclasses.replace(batch))  # a different batch object
    with pytest.raises(RuntimeError, match="begin_step"):
        backend.forward(q, kv + 1, kv, 0, batch, sm_scale=1.0)
    assert torch.equal(pool.k[0], before)  # refused before writing the pool
