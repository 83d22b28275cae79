"""K/V kept across decode steps by the torch backend: what they serve equals attention
over the pool, they are reused or extended only when the step's slots allow it, and the
backend forgets them on any step but decode."""

from __future__ import annotations

from pathlib import Path

import torch
from attention_helpers import POOL, build_batch, contexts_with_sharing, decode_step, fresh

from sprig.kernels.decode_attention import decode_attention_ref
from sprig.radix.kv_cache import LayerKV
from sprig.runtime.attention.cpu import cascade
from sprig.runtime.attention.cpu.kept_kv import ROOM, KeptKV, PrefixKV, TailKV
from sprig.runtime.attention.cpu.plan import DecodePlan
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig


def kept_decode(q, k_buf, v_buf, plan: DecodePlan, kept: KeptKV, scale: float, layer: int = 0) -> torch.Tensor:
    """Cascade decode as the backend runs it: K/V from the kept stores."""
    return cascade.decode_attention(
        q, plan,
        lambda i, bucket: kept.tails.get((layer, i), bucket, LayerKV(k_buf, v_buf, k_buf.dtype)),
        lambda i, bucket: kept.prefixes.get((layer, i), bucket, LayerKV(k_buf, v_buf, k_buf.dtype)),
        sm_scale=scale,
    )


def test_kept_prefix_kv_serves_decode_steps_until_cleared() -> None:
    torch.manual_seed(2)
    contexts, _ = contexts_with_sharing()
    indptr, indices = build_batch(contexts)
    D, scale = 16, 16**-0.5
    k_buf, v_buf = torch.randn(POOL, 2, D), torch.randn(POOL, 2, D)
    q = torch.randn(len(contexts), 4, D)
    plan = DecodePlan.build(indptr, indices, 4, 2)
    kept = KeptKV(budget_bytes=1 << 30)

    def plain() -> torch.Tensor:
        return decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)

    torch.testing.assert_close(kept_decode(q, k_buf, v_buf, plan, kept, scale), plain())
    assert len(kept.prefixes) == len(plan.prefixes) == 2
    bucket = plan.prefixes[0]
    first = kept.prefixes.get((0, 0), bucket, LayerKV(k_buf, v_buf, k_buf.dtype))
    assert all(a is b for a, b in zip(first, kept.prefixes.get((0, 0), bucket, LayerKV(k_buf, v_buf, k_buf.dtype)), strict=True))
    kept_decode(q, k_buf, v_buf, plan, kept, scale, layer=1)
    assert len(kept.prefixes) == 4  # one entry per layer and bucket
    k_buf[plan.sharing.groups[0].slots] += 1.0  # an extend rewrote a shared prefix's slots
    assert not torch.allclose(kept_decode(q, k_buf, v_buf, plan, kept, scale), plain(), atol=1e-3)  # kept K/V are what was read
    kept.clear()
    torch.testing.assert_close(kept_decode(q, k_buf, v_buf, plan, kept, scale), plain())
    other = PrefixKV(budget_bytes=0)  # over budget: gathered every time, nothing kept
    got = other.get((0, 0), bucket, LayerKV(k_buf, v_buf, k_buf.dtype))
    assert len(other) == 0 and got[0] is not other.get((0, 0), bucket, LayerKV(k_buf, v_buf, k_buf.dtype))[0]


def test_kept_remainders_grow_by_each_decode_step() -> None:
    torch.manual_seed(4)
    c = [100]
    system = fresh(40, c)
    # one padded remainder bucket (lengths 9..14) and a request alone; the steps outgrow
    # the buffers more than once
    contexts = [system + fresh(n, c) for n in (9, 14, 12)] + [fresh(13, c)]
    D, scale = 16, 16**-0.5
    k_buf, v_buf = torch.randn(POOL, 2, D), torch.randn(POOL, 2, D)
    kept = KeptKV(budget_bytes=1 << 30)
    entries = []
    steps = 2 * ROOM + 20
    for _ in range(steps):
        new = decode_step(contexts, set(), c)
        k_buf[new], v_buf[new] = torch.randn(len(new), 2, D), torch.randn(len(new), 2, D)  # the step's store
        indptr, indices = build_batch(contexts)
        q = torch.randn(len(contexts), 4, D)
        plan = DecodePlan.build(indptr, indices, 4, 2)
        assert len(plan.rests) == 1 and plan.rests[0].valid is not None
        for layer in range(2):
            got = kept_decode(q, k_buf, v_buf, plan, kept, scale, layer)
            want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        entries.append(len(kept.tails))
    assert entries == [2] * steps  # both layers' buckets kept throughout
    # the kept remainders were extended, not gathered again: rewriting an old slot
    # (which no decode step does) goes unseen until the store is cleared
    k_buf[contexts[0][-5]] += 1.0
    decode_step(contexts, set(), c)
    indptr, indices = build_batch(contexts)
    plan = DecodePlan.build(indptr, indices, 4, 2)
    q = torch.randn(len(contexts), 4, D)
    want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
    assert not torch.allclose(kept_decode(q, k_buf, v_buf, plan, kept, scale), want, atol=1e-3)
    kept.clear()
    torch.testing.assert_close(kept_decode(q, k_buf, v_buf, plan, kept, scale), want, atol=1e-5, rtol=1e-5)


def test_kept_remainders_are_gathered_again_when_the_batch_changes() -> None:
    """Requests leaving (the rows differ), a context with other slots at the same length,
    two tokens at once (a jump-forward): each is read from the pool again."""
    torch.manual_seed(5)
    c = [100]
    contexts = [fresh(n, c) for n in (20, 22, 25, 21)]
    D, scale = 8, 8**-0.5
    k_buf, v_buf = torch.randn(POOL, 1, D), torch.randn(POOL, 1, D)
    kept = KeptKV(budget_bytes=1 << 30)

    def check() -> None:
        indptr, indices = build_batch(contexts)
        q = torch.randn(indptr.numel() - 1, 2, D) * 4
        got = kept_decode(q, k_buf, v_buf, DecodePlan.build(indptr, indices, 2, 1), kept, scale)
        torch.testing.assert_close(got, decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale))

    for leave in (set(), set(), {1}, set(), {0, 2}, set()):
        decode_step(contexts, leave, c)
        check()
    contexts[0] = contexts[0][:10] + fresh(len(contexts[0]) - 10, c)  # same rows and lengths, other slots
    check()
    for ctx in contexts:
        ctx += fresh(2, c)
    check()


def test_kept_remainders_within_the_budget_only() -> None:
    torch.manual_seed(6)
    c = [100]
    contexts = [fresh(30, c), fresh(31, c)]
    k_buf, v_buf = torch.randn(POOL, 1, 8), torch.randn(POOL, 1, 8)
    tails = TailKV(budget_bytes=0)
    for _ in range(2):
        decode_step(contexts, set(), c)
        bucket = DecodePlan.build(*build_batch(contexts), 2, 1).rests[0]
        k, v = tails.get((0, 0), bucket, LayerKV(k_buf, v_buf, k_buf.dtype))
        assert len(tails) == 0
        torch.testing.assert_close(k, k_buf[bucket.slots].transpose(1, 2).float())
        torch.testing.assert_close(v, v_buf[bucket.slots].transpose(1, 2).float())


def test_the_backend_forgets_kept_kv_on_any_step_but_decode(tiny_llama: Path) -> None:
    runner = ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=256))
    backend, cache = runner.backend, runner.kv_cache
    contexts = [[*range(1, 41), 41], [*range(1, 41), 42]]
    indptr, indices = build_batch(contexts)

    def batch(mode: ForwardMode) -> ForwardBatch:
        return ForwardBatch(
            mode=mode, input_ids=torch.tensor([5, 6]), positions=torch.tensor([40, 40]),
            qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr=indptr,
            kv_indices=indices, out_cache_loc=torch.tensor([41, 42]), kv_cache=cache,
            max_q_len=1, max_kv_len=41,
        )

    q, kv = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    decode = batch(ForwardMode.DECODE)
    backend.begin_step(decode)
    backend.forward(q, kv, kv, 0, decode, sm_scale=0.25)
    assert len(backend.kept_kv.prefixes) == 1 and len(backend.kept_kv.tails) == 1
    backend.begin_step(batch(ForwardMode.DECODE))
    assert len(backend.kept_kv.prefixes) == 1 and len(backend.kept_kv.tails) == 1
    backend.begin_step(batch(ForwardMode.EXTEND))
    assert len(backend.kept_kv.prefixes) == 0 and len(backend.kept_kv.tails) == 0
