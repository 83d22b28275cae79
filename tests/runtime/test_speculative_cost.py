"""How many drafts a step verifies: `draft_cap` against hand-computed costs, the flag's
parsing, the startup measurement, and an engine whose costs make drafting pay only at
small batches (the draft model then skips the big-batch steps and catches up after)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_idle_and_intact, hf_greedy

from sprig.runtime import Engine
from sprig.runtime.speculative import decode
from sprig.runtime.speculative.calibrate import calibrate
from sprig.runtime.speculative.cost import (
    Line,
    PassCosts,
    Plane,
    branch_gain,
    draft_cap,
    widen,
)
from sprig.runtime.speculative.draft_length import DraftLength
from sprig.runtime.speculative.ngram import NgramDrafter
from sprig.runtime.speculative.timing import timed_ms

FREE = PassCosts(Line(1, 0), Plane(0, 0, 0), Line(0, 0))  # drafting costs nothing: always the longest drafts


def _rate(rate: float):
    return DraftLength(max_len=8, rate=rate).expected


def test_free_drafts_are_always_verified_and_none_when_nothing_is_proposed() -> None:
    assert draft_cap(FREE, [4, 2, 0], [_rate(0.1)] * 3, model_steps=True) == 4
    assert draft_cap(FREE, [0, 0], [_rate(0.9)] * 2, model_steps=False) == 0


def test_the_cap_is_the_hand_computed_best() -> None:
    """Decode 10 ms; verification 10 ms + 1 ms a token; draft steps 2 ms. For one request
    k drafts cost 11 + 3k ms and yield 1 + sum(rate^i, i = 1..k) tokens; plain decoding
    makes 0.1 token a ms, and drafting must beat 0.102. Rate 0.3: k = 1 makes 1.3 / 14 =
    0.093: none. Rate 0.5: 1.5 / 14 = 0.107, then 1.75 / 17 = 0.103: 1. Rate 0.9:
    1.9 / 14, 2.71 / 17, 3.44 / 20, 4.10 / 23, 4.69 / 26 = 0.1802, 5.22 / 29 = 0.1799: 5."""
    costs = PassCosts(Line(10, 0), Plane(10, 0, 1), Line(2, 0))
    assert draft_cap(costs, [8], [_rate(0.3)], model_steps=True) == 0
    assert draft_cap(costs, [8], [_rate(0.5)], model_steps=True) == 1
    assert draft_cap(costs, [8], [_rate(0.9)], model_steps=True) == 5
    assert draft_cap(costs, [8], [_rate(0.9)], model_steps=False) == 8  # no draft steps: every draft pays


def test_a_big_batch_backs_off() -> None:
    """Per-request costs dominate at a big batch: the same drafts that pay for one
    request do not pay for 64, where verifying 5 tokens each costs about 5 decode passes;
    and a verification pass's own cost per request (off the decode path) counts even
    when few draft."""
    costs = PassCosts(Line(4, 0.2), Plane(4, 0, 0.2), Line(1, 0.05))
    assert draft_cap(costs, [4], [_rate(0.7)], model_steps=True) > 0
    assert draft_cap(costs, [4] * 64, [_rate(0.7)] * 64, model_steps=True) == 0
    per_request = PassCosts(Line(4, 0.2), Plane(4, 0.5, 0.0), Line(0, 0))  # extend costs 0.7 ms a request
    assert draft_cap(per_request, [4] + [0] * 63, [_rate(0.9)] * 64, model_steps=False) == 0
    assert draft_cap(per_request, [4] * 64, [_rate(0.9)] * 64, model_steps=False) > 0


def test_an_alternative_path_gains_what_its_chance_of_being_followed_allows() -> None:
    # rate 0.5, leaving after 0 of 4 draft tokens, 2 tokens: 0.5 (draft rejected) x (0.5 + 0.25)
    assert branch_gain(0.5, 0, 2, 4) == pytest.approx(0.375)
    assert branch_gain(0.5, 1, 3, 4) == pytest.approx(0.5 * 0.5 * 0.75)
    assert branch_gain(0.5, 2, 3, 2) == pytest.approx(0.25 * 0.5)  # the draft ended there: no rejection needed
    assert branch_gain(1.0, 0, 3, 3) == 0.0  # drafts always kept: never followed


def test_alternatives_are_verified_while_they_raise_tokens_per_millisecond() -> None:
    def costs(per_token: float) -> PassCosts:
        return PassCosts(Line(1, 0), Plane(10, 0, per_token), Line(0, 0))

    candidates = [(0.01, 5), (0.375, 3), (0.2, 3)]
    # 2.5 tokens expected of 1 sequence of 5 tokens: 10.5 ms; the best per token first,
    # 0.375 more tokens for 0.3 ms is worth it, 0.2 more for 0.3 ms after it too, 0.01 for 0.5 ms not
    assert widen(costs(0.1), 1, 5, 2.5, candidates) == [1, 2]
    assert widen(costs(1.0), 1, 5, 2.5, candidates) == []  # a token costs 1 ms: none is worth it
    assert widen(costs(0.0), 1, 5, 2.5, candidates) == [0, 1, 2]  # free tokens: all


@pytest.mark.parametrize("text", ["1,2,3", "1,2,3,4,5,6", "1,2,3,4,5,6,x", "1,2,3,4,5,6,-1", ""])
def test_bad_costs_are_refused_naming_the_field(text, tiny_llama) -> None:
    with pytest.raises(ValueError, match="speculative_pass_costs"):
        Engine(tiny_llama, speculative_algorithm="ngram", speculative_pass_costs=text)


def test_costs_round_trip_through_their_text() -> None:
    costs = PassCosts(Line(3.5, 0.125), Plane(4, 0.5, 0.0625), Line(1.25, 0.03))
    assert PassCosts.parse(str(costs)) == costs


def test_calibration_measures_positive_costs(tiny_llama: Path) -> None:
    with Engine(tiny_llama, dtype="float32", speculative_algorithm="draft",
                speculative_draft_model_path=str(tiny_llama)) as engine:
        costs = calibrate(engine.scheduler.runner, engine.scheduler.speculative.drafter, max_batch=8, drafts=4)
        assert_idle_and_intact(engine)
    # a pass costs something (the split between fixed and per-request terms is a fit that
    # a loaded machine can tip to a zero fixed term, as it did with the fuzzer beside it)
    assert min(costs.decode.at(1), costs.draft.at(1), costs.verify.at(1, 5)) > 0
    # terms are kept non-negative, so bigger passes never cost less (strictly more is a
    # timing claim, which a loaded machine can break)
    assert costs.decode.at(8) >= costs.decode.at(1) and costs.verify.at(8, 40) >= costs.verify.at(1, 5)


PROMPTS = ["the cat the cat the cat", "one two three one two", "a quick fox", "how the model caches the prefix"]
MAX_NEWS = [6, 10, 16, 24]
SELF_DRAFT_ACCEPTANCE = 0.97  # a self-draft's drafts differ from the target's tokens only on near-ties


def test_a_draft_skipped_at_big_batches_catches_up(tiny_llama: Path) -> None:
    """Costs under which a fresh request's drafts pay only below 3 running requests: the
    four requests decode without drafts (the draft writes nothing), then the two longest
    draft, their draft K/V computed at once from where it stops. The target is its own
    draft, so its drafts must be kept (the catch-up wrote the right K/V), and the outputs
    are exact."""
    costs = "3,1,3,0,1,0,0.1"  # decode 3 + B ms, verification 3 + N ms, draft steps 0.1 B ms
    fresh = DraftLength(max_len=4).expected
    assert draft_cap(PassCosts.parse(costs), [4] * 3, [fresh] * 3, model_steps=True) == 0
    assert draft_cap(PassCosts.parse(costs), [4], [fresh], model_steps=True) > 0
    want = [hf_greedy(tiny_llama, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEWS, strict=True)]
    with Engine(tiny_llama, dtype="float32", check_integrity=True, speculative_algorithm="draft",
                speculative_draft_model_path=str(tiny_llama), speculative_pass_costs=costs) as engine:
        outs = engine.generate(PROMPTS, [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                                         for n in MAX_NEWS])
        stats = engine.scheduler.speculative.stats
        assert_idle_and_intact(engine)
    assert [o["output_ids"] for o in outs] == want
    assert stats.verify_steps >= MAX_NEWS[1] - 1  # plain passes while 3 or 4 ran (drafting all along: about 6)
    assert stats.drafted > 0 and stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE


@pytest.mark.parametrize("probe", [True, False])
def test_a_pessimistic_prior_is_tested_by_a_probe(probe: bool, tiny_llama: Path, monkeypatch) -> None:
    """Costs under which drafts pay at a rate of 0.75 but not at the prior of a fresh
    request, 0.5: no step drafts until `PROBE_AFTER` steps have passed without drafts; the
    probe's one draft (the target is its own draft: kept) raises the request's rate, and
    it drafts from then on. Without probes it never drafts. Outputs are plain decoding's
    either way."""
    costs = "10,0,10,0,1,3,0"  # decode 10 ms, verification 10 ms + 1 ms a token, draft steps 3 ms
    assert draft_cap(PassCosts.parse(costs), [4], [DraftLength(4).expected], model_steps=True) == 0
    assert draft_cap(PassCosts.parse(costs), [4], [DraftLength(4, rate=0.75).expected], model_steps=True) > 0
    after = decode.PROBE_AFTER
    if not probe:
        monkeypatch.setattr(decode, "PROBE_AFTER", 10**9)
    params = {"max_new_tokens": 3 * after, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_llama, dtype="float32", check_integrity=True, speculative_algorithm="draft",
                speculative_draft_model_path=str(tiny_llama), speculative_pass_costs=costs) as engine:
        out = engine.generate(PROMPTS[0], params)
        stats = engine.scheduler.speculative.stats
        assert_idle_and_intact(engine)
    with Engine(tiny_llama, dtype="float32") as plain:
        assert out["output_ids"] == plain.generate(PROMPTS[0], params)["output_ids"]
    if probe:
        assert stats.drafted > after and stats.acceptance_rate > SELF_DRAFT_ACCEPTANCE
        assert stats.verify_steps < 2 * after
    else:
        assert stats.drafted == 0 and stats.verify_steps == params["max_new_tokens"] - 1


def test_a_probe_that_finds_nothing_waits_like_one_that_drafted(tiny_llama: Path, monkeypatch) -> None:
    """Costs under which drafts never pay, and a drafter that never has anything to
    propose: it is asked once per `PROBE_AFTER` steps (per request), not on every step
    after the first probe, which would make a declining gate pay for proposals anyway.
    Outputs are plain decoding's."""
    costs = "1,0,100,0,1,0,0"  # decode 1 ms, verification 100 ms: no draft is ever worth it
    asked = []
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, context, k: asked.append(len(context)) or [])
    after = decode.PROBE_AFTER
    params = {"max_new_tokens": 4 * after, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_llama, dtype="float32", check_integrity=True, speculative_algorithm="ngram",
                speculative_pass_costs=costs) as engine:
        outs = engine.generate(PROMPTS[:2], params)
        stats = engine.scheduler.speculative.stats
        assert_idle_and_intact(engine)
    with Engine(tiny_llama, dtype="float32") as plain:
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain.generate(PROMPTS[:2], params)]
    assert stats.drafted == 0 and stats.verify_steps == params["max_new_tokens"] - 1
    assert 0 < len(asked) <= 2 * (params["max_new_tokens"] // (after + 1))


def test_steps_without_drafts_are_timed_against_the_decode_line(tiny_llama: Path) -> None:
    """With measured costs, a step in which nothing is drafted (the scheduler's plain
    decode step) corrects the decode line by its pass and draw, as any pass does."""
    with Engine(tiny_llama, dtype="float32", speculative_algorithm="ngram") as engine:
        spec = engine.scheduler.speculative
        spec.drafter.draft = lambda kv, batch, lengths, cap: [[] for _ in batch]  # nothing is ever proposed
        engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert_idle_and_intact(engine)
    assert spec.measured and spec.stats.verify_steps == 7 and spec.stats.drafted == 0
    assert spec.scales.decode != 1.0 and spec.scales.verify == 1.0


def test_a_declining_gate_leaves_the_drafter_unasked_for_a_while(tiny_llama: Path, monkeypatch) -> None:
    """Costs under which drafts never pay, one request: the gate is consulted after 0, 1,
    3, 7, 15, then every 16 steps of declines (and at probes), not on every step: asking
    costs the host each time. Outputs are plain decoding's."""
    costs = "1,0,100,0,1,0,0"  # decode 1 ms, verification 100 ms: no draft is ever worth it
    asked = []
    real = decode.draft_cap
    monkeypatch.setattr(decode, "draft_cap", lambda *args, **kwargs: asked.append(1) or real(*args, **kwargs))
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_llama, dtype="float32", check_integrity=True, speculative_algorithm="ngram",
                speculative_pass_costs=costs) as engine:
        out = engine.generate(PROMPTS[0], params)
        stats = engine.scheduler.speculative.stats
        assert_idle_and_intact(engine)
    with Engine(tiny_llama, dtype="float32") as plain:
        assert out["output_ids"] == plain.generate(PROMPTS[0], params)["output_ids"]
    assert stats.drafted == 0 and stats.verify_steps == params["max_new_tokens"] - 1
    steps = params["max_new_tokens"] - 1  # 1, 2, 4, 8, 16, 32, 48, ..., 112: 12 asks, and up to two probes
    assert 0 < len(asked) <= 5 + steps // (decode.MAX_QUIET + 1) + 2 * (steps // decode.PROBE_AFTER), asked


def test_requests_finishing_one_by_one_leave_the_drafter_unasked(tiny_llama: Path, monkeypatch) -> None:
    """Eight requests that finish one a step, under costs where drafts never pay: a request
    leaving the batch does not end the gate's quiet (the rest were declined already), so
    the drafter is asked as seldom as for one request, not again at every departure."""
    costs = "1,0,100,0,1,0,0"  # decode 1 ms, verification 100 ms: no draft is ever worth it
    asked = []
    real = decode.draft_cap
    monkeypatch.setattr(decode, "draft_cap", lambda *args, **kwargs: asked.append(1) or real(*args, **kwargs))
    params = [{"max_new_tokens": 40 + i, "temperature": 0, "ignore_eos": True} for i in range(8)]
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(8)]
    with Engine(tiny_llama, dtype="float32", check_integrity=True, speculative_algorithm="ngram",
                speculative_pass_costs=costs) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.scheduler.speculative.stats
        assert_idle_and_intact(engine)
    with Engine(tiny_llama, dtype="float32") as plain:
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain.generate(prompts, params)]
    steps = stats.verify_steps  # 47 here: the longest request's tokens after its first, at least
    assert stats.drafted == 0 and steps >= max(p["max_new_tokens"] for p in params) - 1
    # 1, 2, 4, 8, 16, 32: 6 asks in 47 steps (12 when each departure asked again)
    assert 0 < len(asked) <= 5 + steps // (decode.MAX_QUIET + 1), asked


@pytest.mark.gpu
def test_on_cuda_a_timed_pass_waits_for_the_device(monkeypatch) -> None:
    """A pass that returns a CUDA tensor is timed until the device has computed it (a
    graph-replayed pass is one launch: timing the launch alone made it look free); one
    that returns host values (the draft's rounds: token lists) needs no wait."""
    import torch

    waits = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device) or real(device))
    timed_ms(lambda: torch.ones(4, device="cuda"), repeats=3)
    assert len(waits) == 4 and all(torch.device(d).type == "cuda" for d in waits)
    waits.clear()
    timed_ms(lambda: torch.ones(4, device="cuda").tolist(), repeats=3)
    assert waits == []
