"""Shared-prefix (cascade) attention equals the plain per-request reference, for decode
and extend steps, and the engine decodes a shared prompt through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_helpers import POOL, build_batch, contexts_with_sharing, decode_step, fresh
from engine_helpers import assert_idle_and_intact, hf_greedy
from transformers import AutoTokenizer

from sprig.kernels.decode_attention import decode_attention_ref
from sprig.kernels.extend_attention import extend_attention_ref
from sprig.radix.kv_cache import LayerKV
from sprig.runtime import Engine
from sprig.runtime.attention.cpu import cascade
from sprig.runtime.attention.cpu.buckets import gather_bucket_kv, gather_prefix_kv
from sprig.runtime.attention.cpu.plan import DecodePlan, SharingPlan


def plain_decode(q, k_buf, v_buf, plan: DecodePlan, scale: float) -> torch.Tensor:
    """Cascade decode with every K/V gathered from the pool (nothing kept)."""
    return cascade.decode_attention(
        q, plan,
        lambda _, bucket: gather_bucket_kv(LayerKV(k_buf, v_buf, k_buf.dtype), bucket),
        lambda _, bucket: gather_prefix_kv(LayerKV(k_buf, v_buf, k_buf.dtype), bucket),
        sm_scale=scale,
    )


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_the_plain_reference(hq: int, hkv: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    contexts, _ = contexts_with_sharing()
    indptr, indices = build_batch(contexts)
    D = 32
    k_buf = torch.randn(POOL, hkv, D).to(dtype)
    v_buf = torch.randn(POOL, hkv, D).to(dtype)
    q = torch.randn(len(contexts), hq, D).to(dtype)
    got = plain_decode(q, k_buf, v_buf, DecodePlan.build(indptr, indices, hq, hkv), D**-0.5)
    want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=D**-0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.all(got[8] == 0)  # the empty context


def test_decode_writes_each_request_its_own_rows_as_requests_leave() -> None:
    """Buckets whose rows are not in batch order (the longest request's bucket first)
    after requests leave at different steps: every request gets its own attention."""
    torch.manual_seed(9)
    c = [100]
    system = fresh(40, c)
    contexts = [system + fresh(n, c) for n in (3, 90, 5, 60, 4)] + [fresh(n, c) for n in (100, 7)]
    k_buf, v_buf = torch.randn(POOL, 2, 16), torch.randn(POOL, 2, 16)
    for leave in (set(), {0}, {3}, set(), {0, 1}):
        decode_step(contexts, leave, c)
        indptr, indices = build_batch(contexts)
        plan = DecodePlan.build(indptr, indices, 4, 2)
        q = torch.randn(len(contexts), 4, 16) * 4  # sharp attention: a row mix-up shows
        got = plain_decode(q, k_buf, v_buf, plan, 0.25)
        torch.testing.assert_close(got, decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=0.25),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_equals_the_plain_reference(hq: int, hkv: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    contexts, _ = contexts_with_sharing()
    new_tokens = [5, 30, 1, 9, 50, 3, 64, 2, 0, 4, 7, 2, 5, 1]  # each context's own last slots
    indptr, indices = build_batch(contexts)
    qo_indptr = torch.tensor([0, *new_tokens]).cumsum(0).to(torch.int32)
    D = 16
    k_buf = torch.randn(POOL, hkv, D).to(dtype)
    v_buf = torch.randn(POOL, hkv, D).to(dtype)
    q = torch.randn(sum(new_tokens), hq, D).to(dtype)
    plan = SharingPlan.build(indptr, indices)
    assert plan.groups
    got = cascade.extend_attention(q, LayerKV(k_buf, v_buf, k_buf.dtype), qo_indptr, plan, sm_scale=D**-0.5)
    want = extend_attention_ref(q, k_buf, v_buf, qo_indptr, indptr, indices, sm_scale=D**-0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("new", [8, 3])
def test_extend_of_equal_tails_is_batched_and_equals_the_reference(new: int) -> None:
    torch.manual_seed(3)
    c = [100]
    system = fresh(40, c)
    contexts = [system + fresh(8, c) for _ in range(5)] + [system + fresh(6, c), fresh(12, c)]
    new_tokens = [new] * 5 + [2, 12]  # five requests share one (new tokens, remainder) shape
    indptr, indices = build_batch(contexts)
    qo_indptr = torch.tensor([0, *new_tokens]).cumsum(0).to(torch.int32)
    k_buf, v_buf = torch.randn(POOL, 2, 16), torch.randn(POOL, 2, 16)
    q = torch.randn(sum(new_tokens), 4, 16)
    plan = SharingPlan.build(indptr, indices)
    assert [g.members.tolist() for g in plan.groups] == [[0, 1, 2, 3, 4, 5]]
    got = cascade.extend_attention(q, LayerKV(k_buf, v_buf, k_buf.dtype), qo_indptr, plan, sm_scale=0.25)
    want = extend_attention_ref(q, k_buf, v_buf, qo_indptr, indptr, indices, sm_scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_extends_of_unshared_contexts_are_batched_and_equal_the_reference(
    hq: int, hkv: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification-like steps with no shared prefix: requests with the same number of new
    tokens attend in one call per length bucket (padding masked), whatever their context
    lengths; a prefill and a long extend run alone; the results equal the reference."""
    torch.manual_seed(5)
    c = [100]
    lengths = [40, 9, 45, 70, 38, 12, 25, 30, 200, 30]
    new_tokens = [5, 5, 5, 5, 3, 3, 1, 16, 17, 30]  # the last two: past SHORT_EXTEND, and a prefill
    contexts = [fresh(n, c) for n in lengths]
    indptr, indices = build_batch(contexts)
    qo_indptr = torch.tensor([0, *new_tokens]).cumsum(0).to(torch.int32)
    D = 16
    k_buf = torch.randn(POOL, hkv, D).to(dtype)
    v_buf = torch.randn(POOL, hkv, D).to(dtype)
    q = torch.randn(sum(new_tokens), hq, D).to(dtype)
    plan = SharingPlan.build(indptr, indices)
    assert not plan.groups
    calls = []
    real = cascade.attention_lse
    monkeypatch.setattr(cascade, "attention_lse", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    got = cascade.extend_attention(q, LayerKV(k_buf, v_buf, k_buf.dtype), qo_indptr, plan, sm_scale=D**-0.5)
    want = extend_attention_ref(q, k_buf, v_buf, qo_indptr, indptr, indices, sm_scale=D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # 5 new tokens: contexts 70, 45, 40 in one bucket, 9 in another; 3: 38 and 12 apart;
    # 1 and 16: one request each; 17 new tokens and the prefill: per request, not here
    assert sorted(s[0] for s in calls) == [1, 1, 1, 1, 1, 3]


def test_the_engine_decodes_a_shared_prompt_through_the_plan(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped: list[int] = []
    build = DecodePlan.build

    def spy(*args, **kwargs) -> DecodePlan:
        plan = build(*args, **kwargs)
        grouped.append(sum(g.members.numel() for g in plan.sharing.groups))
        return plan

    monkeypatch.setattr(DecodePlan, "build", staticmethod(spy))
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    system = " ".join(["the quick red fox and the blue dog"] * 8)
    assert len(tok.encode(system)) > 40
    prompts = [f"{system} {q}" for q in ["one", "two three", "what cache", "a tree", "how"]]
    with Engine(str(tiny_llama), dtype="float32", attention_backend="torch", shadow_attention=True) as engine:
        outs = engine.generate(prompts, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert_idle_and_intact(engine)
    assert max(grouped) >= 4  # most of the batch decoded over the shared prompt at once
    assert [o["output_ids"] for o in outs] == hf_greedy(tiny_llama, prompts, 12)
