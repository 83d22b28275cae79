"""The torch backend's per-step plan: which requests share a prefix, what remains of each
context, and how the remainders are bucketed, made from the step's metadata alone."""

from __future__ import annotations

import random

import pytest
from attention_helpers import build_batch, contexts_with_sharing, decode_step, fresh

from sprig.runtime.attention.cpu.plan import DecodePlan, SharingPlan


def test_the_plan_finds_each_shared_run_and_keeps_the_rest() -> None:
    contexts, expected = contexts_with_sharing()
    plan = SharingPlan.build(*build_batch(contexts), min_shared=32)
    got = {int(g.members[0]): (g.members.tolist(), g.slots.numel()) for g in plan.groups}
    assert got == expected
    skip = {m: n for members, n in expected.values() for m in members}
    for b, ctx in enumerate(contexts):
        rest = plan.rest(b).tolist()
        assert rest == ctx[skip.get(b, 0) :]
        assert rest or not ctx  # a grouped request always keeps its own tokens
        assert int(plan.shared_lens[b]) == skip.get(b, 0)
    for g in plan.groups:
        assert g.slots.tolist() == contexts[int(g.members[0])][: g.slots.numel()]


def test_no_groups_without_enough_sharing() -> None:
    c = [0]
    shared = fresh(20, c)
    for contexts in ([fresh(50, c), fresh(50, c)], [shared + fresh(5, c), shared + fresh(5, c)],
                     [fresh(50, c)], [[], []], []):
        plan = SharingPlan.build(*build_batch(contexts))
        assert plan.groups == ()
        assert [plan.rest(b).tolist() for b in range(len(contexts))] == contexts


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_split_into_their_groups_and_remainders(seed: int) -> None:
    """Prefixes shared in a tree (a run shared by some, a longer run by fewer of them),
    compared with a per-request Python reading of the same contexts."""
    rng = random.Random(seed)
    c = [1]
    roots = [fresh(rng.randint(1, 60), c) for _ in range(3)]
    branches = [root + fresh(rng.randint(0, 40), c) for root in roots for _ in range(2)]
    contexts = [rng.choice([*branches, []]) + fresh(rng.randint(1, 30), c) for _ in range(rng.randint(1, 12))]
    plan = SharingPlan.build(*build_batch(contexts), min_shared=16)
    by_first: dict[int, list[int]] = {}
    for b, ctx in enumerate(contexts):
        by_first.setdefault(ctx[0], []).append(b)
    want = {}
    for members in by_first.values():
        if len(members) < 2:
            continue
        run = 0
        while all(run < len(contexts[b]) and contexts[b][run] == contexts[members[0]][run] for b in members):
            run += 1
        if run >= 16:
            want[members[0]] = (members, contexts[members[0]][:run])
    got = {int(g.members[0]): (g.members.tolist(), g.slots.tolist()) for g in plan.groups}
    assert got == want
    shared = {b: len(slots) for members, slots in want.values() for b in members}
    assert [plan.rest(b).tolist() for b in range(len(contexts))] == [
        ctx[shared.get(b, 0) :] for b, ctx in enumerate(contexts)
    ]


def assert_decode_plan_describes(plan: DecodePlan, contexts: list[list[int]]) -> None:
    """Each context is its group's slots, then its remainder, which its bucket row holds;
    every request with a remainder sits in exactly one bucket."""
    shared = {int(b): g.slots.tolist() for g in plan.sharing.groups for b in g.members}
    rows = sorted(int(r) for bucket in plan.rests for r in bucket.rows)
    assert rows == [b for b, ctx in enumerate(contexts) if len(ctx) > len(shared.get(b, []))]
    for bucket in plan.rests:
        assert bucket.rows.tolist() == sorted(bucket.rows.tolist())
        for j, row in enumerate(bucket.rows.tolist()):
            n = int(bucket.lens[j])
            assert shared.get(row, []) + bucket.slots[j, :n].tolist() == contexts[row]
            assert bucket.valid is None or bucket.valid[j].tolist() == [i < n for i in range(bucket.valid.shape[1])]
    in_prefixes = [
        row for bucket in plan.prefixes
        for row in (bucket.rows.flatten() if bucket.real is None else bucket.rows[bucket.real]).tolist()
    ]
    assert sorted(in_prefixes) == sorted(shared)


def test_decode_plans_describe_batches_as_requests_leave() -> None:
    contexts, _ = contexts_with_sharing()
    contexts = [ctx for ctx in contexts if ctx]
    c = [4000]
    for leave in (set(), {1}, {2}, {8, 9, 10}, set(), {0}):
        decode_step(contexts, leave, c)
        assert_decode_plan_describes(DecodePlan.build(*build_batch(contexts), 4, 2), contexts)


def test_decode_buckets_pad_similar_lengths_together() -> None:
    contexts, _ = contexts_with_sharing()
    plan = DecodePlan.build(*build_batch(contexts), 8, 2)
    buckets = sorted(plan.prefixes, key=lambda b: b.rows.shape[0])
    assert [b.rows.shape for b in buckets] == [(1, 5), (2, 3)]  # A; B and C padded together
    assert buckets[1].slot_valid is not None and int(buckets[1].real.sum()) == 5
    for bucket in plan.rests:
        longest, shortest = int(bucket.lens.max()), int(bucket.lens.min())
        assert 2 * shortest > longest  # padding at most doubles a bucket's work
