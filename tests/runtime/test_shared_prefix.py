"""Shared-prefix decode attention equals plain decode attention, and the engine uses it
when requests decode over one cached prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, hf_greedy
from transformers import AutoTokenizer

from sprig.kernels.decode_attention import decode_attention_ref
from sprig.kernels.extend_attention import extend_attention_ref
from sprig.runtime import Engine
from sprig.runtime.attention import shared_prefix
from sprig.runtime.attention.shared_prefix import (
    plan_shared_prefixes,
    shared_prefix_decode_attention,
    shared_prefix_extend_attention,
)

POOL = 4096


def build_batch(contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.tensor([0] + [len(c) for c in contexts]).cumsum(0).to(torch.int32)
    return indptr, torch.tensor([s for c in contexts for s in c], dtype=torch.int32)


def fresh(n: int, counter: list[int]) -> list[int]:
    """`n` slots never used before (shuffled, as a paged pool hands them out)."""
    start = counter[0]
    counter[0] += n
    return list(range(start, start + n))[::-1]


def contexts_with_sharing() -> tuple[list[list[int]], dict[int, tuple[list[int], int]]]:
    """A batch mixing shared prefixes (one with a longer shared run inside it; two of
    similar size, attended as one padded bucket), requests that share too little,
    singletons and an empty context; and the expected groups (first member -> members,
    shared length)."""
    c = [100]
    system = fresh(70, c)
    other = fresh(40, c)
    short = fresh(10, c)
    contexts = [
        system + fresh(5, c),  # 0: group A
        fresh(30, c),  # 1: alone
        system + fresh(1, c),  # 2: group A, shortest remainder
        other + fresh(9, c),  # 3: group B
        short + fresh(50, c),  # 4: shares only 10 slots with 5: not grouped
        short + fresh(3, c),  # 5
        system + fresh(64, c),  # 6: group A
        other + fresh(2, c),  # 7: group B
        [],  # 8: no context
    ]
    nested = system + fresh(20, c)
    contexts += [nested + fresh(4, c), nested + fresh(7, c)]  # 9, 10: group A (shares 70 with it)
    third = fresh(36, c)  # group C: padded beside B (more rows than B, fewer shared slots)
    contexts += [third + fresh(n, c) for n in (2, 6, 1)]  # 11, 12, 13
    return contexts, {0: ([0, 2, 6, 9, 10], 70), 3: ([3, 7], 40), 11: ([11, 12, 13], 36)}


def test_the_plan_finds_each_shared_run_and_keeps_the_rest() -> None:
    contexts, expected = contexts_with_sharing()
    indptr, indices = build_batch(contexts)
    plan = plan_shared_prefixes(indptr, indices, min_shared=32)
    got = {int(g.members[0]): (g.members.tolist(), g.slots.numel()) for g in plan.groups}
    assert got == expected
    skip = {m: n for members, n in expected.values() for m in members}
    for b, ctx in enumerate(contexts):
        rest = plan.rest_indices[plan.rest_indptr[b] : plan.rest_indptr[b + 1]].tolist()
        assert rest == ctx[skip.get(b, 0) :]
        assert rest or not ctx  # a grouped request always keeps its own tokens
    for g in plan.groups:
        assert g.slots.tolist() == contexts[int(g.members[0])][: g.slots.numel()]


def test_no_groups_without_enough_sharing() -> None:
    c = [0]
    shared = fresh(20, c)
    for contexts in ([fresh(50, c), fresh(50, c)], [shared + fresh(5, c), shared + fresh(5, c)],
                     [fresh(50, c)], [[], []], []):
        indptr, indices = build_batch(contexts)
        plan = plan_shared_prefixes(indptr, indices)
        assert plan.groups == ()
        assert plan.rest_indptr.tolist() == indptr.tolist() and plan.rest_indices.tolist() == indices.tolist()


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_plain_decode_attention(hq: int, hkv: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    contexts, _ = contexts_with_sharing()
    indptr, indices = build_batch(contexts)
    D = 32
    k_buf = torch.randn(POOL, hkv, D).to(dtype)
    v_buf = torch.randn(POOL, hkv, D).to(dtype)
    q = torch.randn(len(contexts), hq, D).to(dtype)
    plan = plan_shared_prefixes(indptr, indices)
    buckets = sorted(plan.decode_groups, key=lambda b: b.rows.shape[0])
    assert [b.rows.shape for b in buckets] == [(1, 5), (2, 3)]  # A; B and C padded together
    assert buckets[1].slot_valid is not None and int(buckets[1].real.sum()) == 5
    got = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=D**-0.5)
    want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=D**-0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.all(got[8] == 0)  # the empty context


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
    plan = plan_shared_prefixes(indptr, indices)
    assert plan.groups
    got = shared_prefix_extend_attention(q, k_buf, v_buf, qo_indptr, plan, sm_scale=D**-0.5)
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
    plan = plan_shared_prefixes(indptr, indices)
    assert [g.members.tolist() for g in plan.groups] == [[0, 1, 2, 3, 4, 5]]
    got = shared_prefix_extend_attention(q, k_buf, v_buf, qo_indptr, plan, sm_scale=0.25)
    want = extend_attention_ref(q, k_buf, v_buf, qo_indptr, indptr, indices, sm_scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_engine_decodes_a_shared_prompt_through_the_plan(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped: list[int] = []
    real_plan = shared_prefix.plan_shared_prefixes

    def spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        grouped.append(sum(g.members.numel() for g in plan.groups))
        return plan

    monkeypatch.setattr("sprig.runtime.attention.torch_backend.plan_shared_prefixes", spy)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    system = " ".join(["the quick red fox and the blue dog"] * 8)
    assert len(tok.encode(system)) > 40
    prompts = [f"{system} {q}" for q in ["one", "two three", "what cache", "a tree", "how"]]
    with Engine(str(tiny_llama), dtype="float32", attention_backend="torch") as engine:
        outs = engine.generate(prompts, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert_idle_and_intact(engine)
    assert max(grouped) >= 4  # most of the batch decoded over the shared prompt at once
    assert [o["output_ids"] for o in outs] == hf_greedy(tiny_llama, prompts, 12)


def decode_step(contexts: list[list[int]], leave: set[int], c: list[int]) -> tuple[list[int], list[int]]:
    """Drop the contexts at positions `leave`, give every other one a fresh slot; returns
    (the rows kept, the new slots)."""
    rows = [b for b in range(len(contexts)) if b not in leave]
    contexts[:] = [contexts[b] for b in rows]
    new = fresh(len(contexts), c)
    for ctx, slot in zip(contexts, new, strict=True):
        ctx.append(slot)
    return rows, new


def assert_plan_describes(plan: shared_prefix.SharingPlan, contexts: list[list[int]]) -> None:
    """Each context is its group's slots, then its remainder, which its bucket row holds."""
    shared = {int(b): g.slots.tolist() for g in plan.groups for b in g.members}
    for b, ctx in enumerate(contexts):
        rest = plan.rest_indices[plan.rest_indptr[b] : plan.rest_indptr[b + 1]].tolist()
        assert shared.get(b, []) + rest == ctx
        assert rest or not ctx
    rows = [int(r) for bucket in plan.rest_padded for r in bucket.rows]
    assert sorted(rows) == list(range(len(contexts)))
    for bucket in plan.rest_padded:
        for j, row in enumerate(bucket.rows.tolist()):
            n = int(bucket.lens[j])
            assert bucket.slots[j, :n].tolist() == contexts[row][len(shared.get(row, [])) :]
            assert bucket.valid is None or bucket.valid[j].tolist() == [i < n for i in range(bucket.valid.shape[1])]


def test_a_plan_advanced_by_decode_steps_describes_the_batch() -> None:
    """Steps where every request stays equal a fresh plan; steps where requests leave
    (a group left with one member, a group gone) keep the rest grouped as before."""
    torch.manual_seed(7)
    contexts, _ = contexts_with_sharing()
    contexts = [ctx for ctx in contexts if ctx]  # a decode step gives every context a slot
    c = [4000]
    k_buf, v_buf = torch.randn(POOL + 100, 2, 16), torch.randn(POOL + 100, 2, 16)
    plan = plan_shared_prefixes(*build_batch(contexts))
    assert plan.rest_padded and plan.decode_groups  # built, as a decode step builds them
    # rows leaving: none; the one alone; a member of B (leaving one); all of C; none
    for step, leave in enumerate((set(), {1}, {2}, {8, 9, 10}, set())):
        rows, new = decode_step(contexts, leave, c)
        indptr, indices = build_batch(contexts)
        advanced = plan.after_decode(indptr, indices, torch.tensor(new), torch.tensor(rows))
        assert advanced is not None and "rest_padded" in vars(advanced)  # grown, not planned again
        assert_plan_describes(advanced, contexts)
        if step == 0:  # no request has left yet
            fresh_plan = plan_shared_prefixes(indptr, indices)
            assert [(g.members.tolist(), g.slots.tolist()) for g in advanced.groups] == [
                (g.members.tolist(), g.slots.tolist()) for g in fresh_plan.groups
            ]
        q = torch.randn(len(contexts), 4, 16)
        got = shared_prefix_decode_attention(q, k_buf, v_buf, advanced, sm_scale=0.25)
        want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=0.25)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plan = advanced
    assert [g.members.numel() for g in plan.groups] == [5, 1]  # A whole, B with one, C gone


def test_a_plan_does_not_advance_to_a_batch_of_other_lengths() -> None:
    contexts, _ = contexts_with_sharing()
    contexts = [ctx for ctx in contexts if ctx]
    c = [4000]
    plan = plan_shared_prefixes(*build_batch(contexts))

    def advance(batch: list[list[int]], rows: list[int]) -> shared_prefix.SharingPlan | None:
        new = torch.tensor([ctx[-1] for ctx in batch])
        return plan.after_decode(*build_batch(batch), new, torch.tensor(rows))

    every = list(range(len(contexts)))
    grown = [ctx + fresh(1, c) for ctx in contexts]
    assert advance(grown, every) is not None
    assert advance(grown[:-1], every[:-1]) is not None  # the last request left
    assert advance(grown[:-1], every[1:]) is None  # the rows named are not these contexts
    assert advance([grown[0] + fresh(1, c), *grown[1:]], every) is None  # two new slots
    assert advance(contexts, every) is None  # no new slot
    assert advance([*grown, grown[0]], [*every, len(every)]) is None  # a row the plan never had
