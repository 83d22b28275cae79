"""Speculative decoding in the engine: each drafter's outputs equal plain decoding's (and
transformers') token for token, greedy and seeded, under every scheduler path; the KV
accounting stays exact. The `draft` drafter's model is the target's first layer
(`draft_checkpoints.truncated_draft`): a smaller checkpoint whose drafts are often right."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from draft_checkpoints import truncated_draft
from engine_helpers import assert_idle_and_intact, hf_greedy

from sprig.runtime import Engine
from sprig.runtime.speculative.decode import SpeculativeDecoder
from sprig.runtime.speculative.drafter import ContextDrafts

ALGORITHMS = ["ngram", "radix", "draft"]
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"]
# repetitive prompts, so prompt lookup finds matches; tiny random models also loop
PROMPTS = [
    "the cat the cat the cat the cat",
    "one two three one two three one",
    "a quick fox",
    "red blue red blue red blue red blue red",
    "how the model caches the prefix tree of the request",
]
MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def outputs(engine: Engine, prompts: list[str], params: dict, **kwargs) -> list[dict]:
    outs = engine.generate(prompts, params, **kwargs)
    assert_idle_and_intact(engine)
    return outs


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def references(tiny_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(tiny_checkpoints[arch], PROMPTS, MAX_NEW) for arch in ARCHS}


def _spec_engine(path: Path, algorithm: str, **options) -> Engine:
    """Drafting whenever the drafter proposes: these tests check verification, not its economics."""
    if algorithm == "draft":
        options.setdefault("speculative_draft_model_path", str(truncated_draft(path)))
    return Engine(path, dtype="float32", check_integrity=True, speculative_algorithm=algorithm,
                  speculative_pass_costs="1,0,0,0,0,0,0", **options)


# Every architecture verifies token trees (radix) and a draft model's chains (draft, its
# draft of the same architecture); ngram's chains are verified as the draft's are, and its
# proposals do not depend on the model: llama here, qwen2 under every scheduler option.
ARCH_ALGORITHMS = [(arch, algorithm) for arch in ARCHS for algorithm in ALGORITHMS
                   if algorithm != "ngram" or arch == "llama"]


@pytest.mark.parametrize(("arch", "algorithm"), ARCH_ALGORITHMS)
def test_greedy_equals_transformers(arch, algorithm, tiny_checkpoints, references) -> None:
    with _spec_engine(tiny_checkpoints[arch], algorithm) as engine:
        cold = outputs(engine, PROMPTS, GREEDY)
        warm = outputs(engine, PROMPTS, GREEDY)  # the radix drafter now finds the first run's outputs
        assert ids(cold) == references[arch]
        assert ids(warm) == references[arch]
        stats = engine.scheduler.speculative.stats
        assert stats.accepted > 0 and stats.mean_accept_length > 1.0
        metas = [o["meta_info"] for o in cold + warm]
        passes = sum(m["spec_verify_ct"] for m in metas)
        assert passes < 2 * len(PROMPTS) * (MAX_NEW - 1)  # fewer target passes per request than plain decoding
        for meta in metas:
            assert_spec_counts(meta)
        assert sum(m["spec_num_correct_drafts"] for m in metas) == stats.accepted
        assert sum(m["spec_num_proposed_drafts"] for m in metas) == stats.drafted


def assert_spec_counts(meta: dict) -> None:
    """A request's speculative counts in `meta_info` agree with each other and with its
    tokens: the first from prefill, then each pass's kept drafts and its own token."""
    hist = meta["spec_correct_drafts_histogram"]
    kept = sum(k * n for k, n in enumerate(hist))
    assert meta["spec_verify_ct"] == sum(hist) > 0
    assert meta["spec_num_correct_drafts"] == kept <= meta["spec_num_proposed_drafts"]
    assert meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + kept  # never cut short: ignore_eos, no stops
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    drafted = meta["spec_num_proposed_drafts"]
    assert meta["spec_accept_rate"] == pytest.approx(kept / drafted if drafted else 0.0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_step_without_drafts_is_the_plain_decode_step(algorithm, tiny_checkpoints, references, monkeypatch) -> None:
    """Where the gate declines every draft (a verification pass priced at a second), each
    step is the scheduler's plain decode step, never a verification pass of its own, and
    counts as a verification of no drafts: transformers' tokens, plain decoding's
    logprobs, one pass per token after the first."""
    monkeypatch.setattr(SpeculativeDecoder, "_step", lambda *args: pytest.fail("a verification pass ran"))
    path = tiny_checkpoints["llama"]
    with Engine(path, dtype="float32") as plain:
        want = outputs(plain, PROMPTS, GREEDY, return_logprob=True)
    draft = {"speculative_draft_model_path": str(truncated_draft(path))} if algorithm == "draft" else {}
    with Engine(path, dtype="float32", check_integrity=True, speculative_algorithm=algorithm,
                speculative_pass_costs="1,0,1000,0,0,0,0", **draft) as engine:
        got = outputs(engine, PROMPTS, GREEDY, return_logprob=True)
        stats = engine.scheduler.speculative.stats
    assert ids(got) == references["llama"] == ids(want)
    for g, w in zip(got, want, strict=True):
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        assert g["meta_info"]["spec_verify_ct"] == MAX_NEW - 1
        assert g["meta_info"]["spec_correct_drafts_histogram"] == [MAX_NEW - 1]
        assert g["meta_info"]["spec_num_proposed_drafts"] == 0 and g["meta_info"]["spec_accept_rate"] == 0.0
    assert stats.drafted == 0 and stats.request_steps == stats.emitted == len(PROMPTS) * (MAX_NEW - 1)


@pytest.mark.parametrize(
    "options",
    [
        {"chunked_prefill_size": 5},
        {"page_size": 4},
        {"page_size": 16, "max_total_tokens": 4096},
        {"disable_radix_cache": True},
        {"max_running_requests": 2, "schedule_policy": "lpm"},
        {"max_total_tokens": 96, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
        {"attention_backend": "triton", "page_size": 4},
    ],
    ids=["chunked-5", "page-4", "page-16", "no-cache", "two-running", "retraction", "triton"],
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_greedy_equals_transformers_under_scheduler_options(algorithm, options, tiny_checkpoints, references) -> None:
    # interpreted Triton kernels are slow on the CPU: there two prompts, half as long (for ngram one,
    # whole: the tiny model repeats its prompt, which prompt lookup needs, only ~15 tokens in), and a
    # warm run (prefixes cached) only for radix, which drafts from it: its prefix hits stand for all three
    count, new, runs = len(PROMPTS), MAX_NEW, 2
    if options.get("attention_backend") == "triton":
        count, new = (1, MAX_NEW) if algorithm == "ngram" else (2, MAX_NEW // 2)
        runs = 2 if algorithm == "radix" else 1
    want = [ref[:new] for ref in references["qwen2"][:count]]  # greedy, ignoring EOS: a prefix of the longer run
    with _spec_engine(tiny_checkpoints["qwen2"], algorithm, **options) as engine:
        for _ in range(runs):
            assert ids(outputs(engine, PROMPTS[:count], {**GREEDY, "max_new_tokens": new})) == want
        if not (algorithm == "radix" and options.get("disable_radix_cache")):  # radix drafts from the cache
            assert engine.scheduler.speculative.stats.drafted > 0
        if "max_total_tokens" in options and options["max_total_tokens"] < 100:
            assert engine.scheduler.stats.retractions > 0


SAMPLED = [
    {"temperature": 0.8, "sampling_seed": 11, "n": 3},
    {"temperature": 1.2, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "sampling_seed": 3},
    {"temperature": 0.7, "sampling_seed": 5, "frequency_penalty": 0.5, "presence_penalty": 0.3,
     "repetition_penalty": 1.3, "logit_bias": {"40": 2.0, "41": -3.0}},
    {"temperature": 0, "min_new_tokens": 10, "stop_token_ids": [40, 41, 42, 43, 44, 45]},
    {"temperature": 0.9, "sampling_seed": 2, "stop": [" the", "ca"]},
]


class CorruptedOracle:
    """Proposes the continuation a plain run produced, each token replaced by a random one
    with probability 0.3: drafts that are often right and often wrong."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.rng = random.Random(0)

    def propose(self, context, k: int) -> list[int]:
        context = list(context)
        for seq in self.sequences:
            if len(seq) > len(context) and seq[: len(context)] == context:
                return [t if self.rng.random() > 0.3 else self.rng.randrange(512) for t in seq[len(context) :][:k]]
        return []

    def alternatives(self, context, k: int, width: int) -> list[list[int]]:
        return []


SAMPLED_IDS = ["n3", "filters", "penalties", "min-new", "stop-strings"]
# Every sampling option under partial acceptance of chains (oracle: every acceptance length)
# and of token trees (radix); ngram's chains are the oracle's, from another proposer; the
# draft model's, under n = 3 and stop strings, are test_speculative_draft_model's.
SEEDED_CASES = [pytest.param(algorithm, params, id=f"{algorithm}-{name}")
                for algorithm, names in [("oracle", SAMPLED_IDS), ("radix", SAMPLED_IDS), ("ngram", ["n3"]),
                                         ("draft", ["filters", "penalties", "min-new"])]
                for params, name in zip(SAMPLED, SAMPLED_IDS, strict=True) if name in names]


@pytest.mark.parametrize(("algorithm", "params"), SEEDED_CASES)
def test_seeded_outputs_do_not_depend_on_speculation(algorithm, params, tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    sp = {"max_new_tokens": MAX_NEW, "ignore_eos": True, **params}
    with Engine(path, dtype="float32") as plain:
        want = outputs(plain, PROMPTS, sp, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[7, 3])
        want_warm = outputs(plain, PROMPTS, sp, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[7, 3])
    with _spec_engine(path, "ngram" if algorithm == "oracle" else algorithm) as engine:
        stats = engine.scheduler.speculative.stats
        if algorithm == "oracle":
            known = [engine.tokenizer.encode(p) + o["output_ids"] for p in PROMPTS for o in want]
            engine.scheduler.speculative.drafter = ContextDrafts(CorruptedOracle(known))
        got = outputs(engine, PROMPTS, sp, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[7, 3])
        got_warm = outputs(engine, PROMPTS, sp, return_logprob=True, top_logprobs_num=3, token_ids_logprob=[7, 3])
        if algorithm == "oracle":  # drafts accepted in part: every acceptance length is exercised
            assert 0 < stats.accepted < stats.drafted
        if algorithm == "radix":  # the warm run's drafts are the cold run's outputs
            assert stats.accepted > 0
    for g, w in zip(got + got_warm, want + want_warm, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        assert g["text"] == w["text"]
        got_lp, want_lp = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]
        assert [lp for lp, _, _ in got_lp] == pytest.approx([lp for lp, _, _ in want_lp], abs=1e-5)
        for key in ("output_top_logprobs", "output_token_ids_logprobs"):
            for a, b in zip(g["meta_info"][key], w["meta_info"][key], strict=True):
                assert [e[0] for e in a] == pytest.approx([e[0] for e in b], abs=1e-5)
        assert len(g["meta_info"]["output_token_ids_logprobs"]) == len(g["output_ids"])


@pytest.mark.parametrize("options", [{}, {"max_total_tokens": 200, "chunked_prefill_size": 8}])
def test_radix_token_trees_keep_seeded_outputs(options, tiny_checkpoints) -> None:
    """A seeded sample, then requests that leave its path after 3 and 9 of its tokens (so
    the tree branches there, their branches the more visited), then the sample again: its
    drafts follow those branches, and the sample's own path, verified beside them as
    an alternative, is what it follows. Every output equals its plain run, logprobs
    included; the slots of paths not followed are freed (integrity checked after every
    step; a tight pool as well)."""
    path = tiny_checkpoints["llama"]
    sample = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.7, "sampling_seed": 1}
    with Engine(path, dtype="float32") as plain:
        ids = plain.tokenizer.encode(PROMPTS[0])
        a = outputs(plain, None, sample, input_ids=[ids])[0]["output_ids"]
        leave = [ids + a[:d] + [(a[d] + 1) % 500 + 5] for d in (3, 9)]
        requests = [([ids], sample), *[(leave, GREEDY)] * 3, ([ids], sample)]  # the leaving paths more visited
        want = [outputs(plain, None, sp, input_ids=p, return_logprob=True) for p, sp in requests]
    with _spec_engine(path, "radix", **options) as engine:
        got = [outputs(engine, None, sp, input_ids=p, return_logprob=True) for p, sp in requests]
        stats = engine.scheduler.speculative.stats
        assert stats.alternatives_kept > 0 and stats.alternatives >= stats.alternatives_kept
    metas = [o["meta_info"] for outs in got for o in outs]
    for meta in metas:
        assert_spec_counts(meta)
    assert sum(m["spec_num_proposed_drafts"] for m in metas) == stats.drafted  # a tree's paths counted
    assert sum(m["spec_num_correct_drafts"] for m in metas) == stats.accepted
    for g, w in zip([o for outs in got for o in outs], [o for outs in want for o in outs], strict=True):
        assert g["output_ids"] == w["output_ids"]
        got_lp, want_lp = g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"]
        assert [lp for lp, _, _ in got_lp] == pytest.approx([lp for lp, _, _ in want_lp], abs=1e-5)


CONSTRAINED = [  # greedy and seeded; a regex the tiny model loops in, a schema, and one behind a reasoning gate
    {"max_new_tokens": 20, "temperature": 0, "regex": "(ab|cd)+x"},
    {"max_new_tokens": 20, "temperature": 0.9, "seed": 7, "regex": "(ab|cd)+x"},
    {"max_new_tokens": 20, "temperature": 0, "json_schema": {
        "type": "object", "properties": {"word": {"enum": ["the cat", "the dog"]}}, "required": ["word"]}},
    {"max_new_tokens": 20, "temperature": 0, "regex": "(ab)+", "reasoning_end": "e", "thinking_budget": 6},
    {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, "reasoning_end": "e", "thinking_budget": 3},
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_requests_are_drafted_for_and_keep_their_grammar(algorithm, jump_forward,
                                                                     tiny_checkpoints) -> None:
    """Drafts of constrained requests are cut to their grammars and verified row by row
    under the grammar's mask after the drafts before it: the outputs are plain decoding's,
    with jump-forward on or off, and drafts are kept (on the alternative paths of token
    trees too, each cut and masked by the grammar alike). The radix drafter runs the prompts
    twice: in one batch the requests run side by side, and what it finds cached in the
    first run depends on how grammar compiles staggered their starts."""
    path = tiny_checkpoints["llama"]
    prompts = PROMPTS[:2] * len(CONSTRAINED)
    params = [p for p in CONSTRAINED for _ in range(2)]
    with Engine(path, dtype="float32", enable_jump_forward=jump_forward) as plain:
        want = plain.generate(prompts, params)
    with _spec_engine(path, algorithm, enable_jump_forward=jump_forward) as engine:
        runs = [engine.generate(prompts, params) for _ in range(2 if algorithm == "radix" else 1)]
        assert_idle_and_intact(engine)
        stats = engine.scheduler.speculative.stats
    for got in runs:
        assert ids(got) == ids(want)
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in runs[-1]) > 0
    if algorithm == "radix":  # every request here is constrained: its token trees' paths are masked too
        assert stats.alternatives_kept > 0
    for o in runs[-1][:4]:
        text, stopped = o["text"], o["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch("(ab|cd)+x" if stopped else "(ab|cd)*(a|c)?", text), text


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_aborts_mid_verification_free_everything(algorithm, tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    with _spec_engine(path, algorithm) as engine:
        sched = engine.scheduler
        engine.generate(PROMPTS, GREEDY)  # cache them
        from sprig.runtime.sampling import SamplingParams
        from sprig.runtime.scheduler.request import Req

        reqs = [Req(rid=f"a{i}", prompt_ids=engine.tokenizer.encode(p), params=SamplingParams.from_dict(GREEDY))
                for i, p in enumerate(PROMPTS)]
        for r in reqs:
            sched.add_request(r)
        for _ in range(4):
            sched.step()
        for r in reqs[::2]:
            sched.abort(r.rid)
        sched.check_integrity()
        while sched.has_work:
            sched.step()
        assert_idle_and_intact(engine)
        assert all(r.finish.type == "abort" for r in reqs[::2])
        assert all(len(r.output_ids) == MAX_NEW for r in reqs[1::2])
