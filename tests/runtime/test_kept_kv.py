"""K/V kept across decode steps by the torch backend: what they serve equals attention
over the pool, they are reused or extended only when the batch allows it, and the backend
forgets them on any step but decode."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from engine_helpers import assert_idle_and_intact, make_prompts
from test_shared_prefix import POOL, build_batch, contexts_with_sharing, fresh

from sprig.kernels.decode_attention import decode_attention_ref
from sprig.runtime import Engine
from sprig.runtime.attention.kept_kv import ROOM, KeptKV, PrefixKV, TailKV
from sprig.runtime.attention.shared_prefix import (
    plan_shared_prefixes,
    shared_prefix_decode_attention,
)
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.model_runner import ModelRunner, RunnerConfig
from sprig.runtime.step_input import StepInput


def test_kept_prefix_kv_serves_decode_steps_until_cleared() -> None:
    torch.manual_seed(2)
    contexts, _ = contexts_with_sharing()
    indptr, indices = build_batch(contexts)
    D, scale = 16, 16**-0.5
    k_buf, v_buf = torch.randn(POOL, 2, D), torch.randn(POOL, 2, D)
    q = torch.randn(len(contexts), 4, D)
    plan = plan_shared_prefixes(indptr, indices)
    kept = KeptKV(budget_bytes=1 << 30)

    def attend(layer: int = 0) -> torch.Tensor:
        return shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept, layer=layer)

    def plain() -> torch.Tensor:
        return decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)

    torch.testing.assert_close(attend(), plain())
    assert len(kept.prefixes) == len(plan.decode_groups) == 2
    bucket = plan.decode_groups[0]
    first = kept.prefixes.get((0, 0), bucket, k_buf, v_buf)
    assert all(a is b for a, b in zip(first, kept.prefixes.get((0, 0), bucket, k_buf, v_buf), strict=True))
    attend(layer=1)
    assert len(kept.prefixes) == 4  # one entry per layer and bucket
    k_buf[plan.groups[0].slots] += 1.0  # an extend rewrote a shared prefix's slots
    assert not torch.allclose(attend(), plain(), atol=1e-3)  # kept K/V are what was read
    kept.clear()
    torch.testing.assert_close(attend(), plain())
    other = PrefixKV(budget_bytes=0)  # over budget: gathered every time, nothing kept
    got = other.get((0, 0), bucket, k_buf, v_buf)
    assert len(other) == 0 and got[0] is not other.get((0, 0), bucket, k_buf, v_buf)[0]


def decode_steps(contexts: list[list[int]], steps: int, c: list[int]):
    """Each step appends one fresh slot to every context; yields (indptr, indices, new slots)."""
    for _ in range(steps):
        new = [fresh(1, c)[0] for _ in contexts]
        for ctx, slot in zip(contexts, new, strict=True):
            ctx.append(slot)
        indptr, indices = build_batch(contexts)
        yield indptr, indices, new


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
    for indptr, indices, new in decode_steps(contexts, steps, c):
        k_buf[new], v_buf[new] = torch.randn(len(new), 2, D), torch.randn(len(new), 2, D)  # the step's store
        q = torch.randn(len(contexts), 4, D)
        plan = plan_shared_prefixes(indptr, indices)
        assert len(plan.rest_padded) == 1 and plan.rest_padded[0].valid is not None
        for layer in range(2):
            got = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept, layer=layer)
            want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        entries.append(len(kept.tails))
    assert entries == [2] * steps  # both layers' buckets kept throughout
    # the kept remainders were extended, not gathered again: rewriting an old slot
    # (which no decode step does) goes unseen until the store is cleared
    old = contexts[0][-5]
    k_buf[old] += 1.0
    (indptr, indices, new), = decode_steps(contexts, 1, c)
    plan = plan_shared_prefixes(indptr, indices)
    q = torch.randn(len(contexts), 4, D)
    want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
    stale = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept)
    assert not torch.allclose(stale, want, atol=1e-3)
    kept.clear()
    fixed = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept)
    torch.testing.assert_close(fixed, want, atol=1e-5, rtol=1e-5)


def test_kept_remainders_are_gathered_again_when_the_batch_changes() -> None:
    torch.manual_seed(5)
    c = [100]
    contexts = [fresh(n, c) for n in (20, 22, 25)]
    D, scale = 8, 8**-0.5
    k_buf, v_buf = torch.randn(POOL, 1, D), torch.randn(POOL, 1, D)
    kept = KeptKV(budget_bytes=1 << 30)

    def check(indptr: torch.Tensor, indices: torch.Tensor) -> None:
        q = torch.randn(indptr.numel() - 1, 2, D)
        plan = plan_shared_prefixes(indptr, indices)
        got = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept)
        torch.testing.assert_close(got, decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale))

    for indptr, indices, _ in decode_steps(contexts, 2, c):
        check(indptr, indices)
    contexts.pop(1)  # a request finished: the rows differ
    for indptr, indices, _ in decode_steps(contexts, 2, c):
        check(indptr, indices)
    contexts[0] = contexts[0][:10] + fresh(12, c)  # same rows and lengths, other slots
    check(*build_batch(contexts))
    for ctx in contexts:  # two tokens at once (a jump-forward): lengths grew by two
        ctx += fresh(2, c)
    check(*build_batch(contexts))


def test_kept_remainders_within_the_budget_only() -> None:
    torch.manual_seed(6)
    c = [100]
    contexts = [fresh(30, c), fresh(31, c)]
    k_buf, v_buf = torch.randn(POOL, 1, 8), torch.randn(POOL, 1, 8)
    tails = TailKV(budget_bytes=0)
    for indptr, indices, _ in decode_steps(contexts, 2, c):
        plan = plan_shared_prefixes(indptr, indices)
        k, v = tails.get((0, 0), plan.rest_padded[0], k_buf, v_buf)
        torch.testing.assert_close(v, v_buf[plan.rest_padded[0].slots].transpose(1, 2).float())
        assert len(tails) == 0
        want = k_buf[plan.rest_padded[0].slots].transpose(1, 2)
        torch.testing.assert_close(k, want.float())


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


def test_the_scheduler_declares_which_requests_a_decode_step_continues(tiny_llama: Path) -> None:
    """Requests finishing at different times and retracted for room: a step that names
    its requests' rows in the previous step (`prev_rows`) follows a decode step, and each
    of its contexts is that row's context then plus one slot."""
    options = {"max_total_tokens": 160, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0}
    with Engine(tiny_llama, dtype="float32", check_integrity=True, **options) as engine:
        steps: list[StepInput] = []
        forward = engine.scheduler.runner.forward

        def recording(step: StepInput) -> torch.Tensor:
            steps.append(step)
            return forward(step)

        engine.scheduler.runner.forward = recording
        system = make_prompts(1, seed=3)[0] * 2
        prompts = [system + " " + p for p in make_prompts(12, seed=4)]
        params = [{"max_new_tokens": 6 + 3 * (i % 5), "temperature": 0, "ignore_eos": True} for i in range(12)]
        engine.generate(prompts, params)
        assert engine.scheduler.stats.retractions > 0
        assert_idle_and_intact(engine)

    def contexts(step: StepInput) -> list[list[int]]:
        ends = [0, *itertools.accumulate(step.kv_lens)]
        return [step.kv_indices[a:b].tolist() for a, b in itertools.pairwise(ends)]

    kept, shrunk = 0, 0
    for before, step in itertools.pairwise(steps):
        if step.prev_rows is None:
            continue
        assert before.mode is ForwardMode.DECODE and step.mode is ForwardMode.DECODE
        old, new = contexts(before), contexts(step)
        assert [new[b][:-1] for b in range(len(new))] == [old[r] for r in step.prev_rows]
        kept += 1
        shrunk += len(step.prev_rows) < len(before.q_lens)
    decodes = sum(s.mode is ForwardMode.DECODE for s in steps)
    assert 0 < shrunk < kept < decodes  # requests left; a step after an extend continues nothing


def test_kept_remainders_keep_the_rows_that_stay_when_requests_leave() -> None:
    torch.manual_seed(8)
    c = [100]
    system = fresh(40, c)
    contexts = [system + fresh(n, c) for n in (9, 14, 12, 10, 11)] + [fresh(13, c)]
    D, scale = 16, 16**-0.5
    k_buf, v_buf = torch.randn(POOL, 2, D), torch.randn(POOL, 2, D)
    kept = KeptKV(budget_bytes=1 << 30)
    plan = plan_shared_prefixes(*build_batch(contexts))
    for leave in (set(), {1}, set(), {0, 3}, set()):
        rows = [b for b in range(len(contexts)) if b not in leave]
        contexts = [contexts[b] for b in rows]
        new = fresh(len(contexts), c)
        for ctx, slot in zip(contexts, new, strict=True):
            ctx.append(slot)
        k_buf[new], v_buf[new] = torch.randn(len(new), 2, D), torch.randn(len(new), 2, D)  # the step's store
        indptr, indices = build_batch(contexts)
        plan = plan.after_decode(indptr, indices, torch.tensor(new), torch.tensor(rows))
        q = torch.randn(len(contexts), 4, D)
        got = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept)
        want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(kept.tails) == len(plan.rest_padded)
    # a step where the first request leaves keeps the others' K/V, not gathering them again:
    # an old slot rewritten (which no decode step does) goes unseen
    rows, new = list(range(1, len(contexts))), fresh(len(contexts) - 1, c)
    contexts = [[*ctx, slot] for ctx, slot in zip(contexts[1:], new, strict=True)]
    k_buf[contexts[0][-4]] += 1.0
    indptr, indices = build_batch(contexts)
    plan = plan.after_decode(indptr, indices, torch.tensor(new), torch.tensor(rows))
    q = torch.randn(len(contexts), 4, D)
    stale = shared_prefix_decode_attention(q, k_buf, v_buf, plan, sm_scale=scale, kept=kept)
    want = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
    assert not torch.allclose(stale, want, atol=1e-3)
