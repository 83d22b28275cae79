"""Meta-generation strategies: right answers, and costs added up from canned meta_info
(the scripted backend reports prompt_tokens = len(text), completion_tokens = len(reply),
cached_tokens = longest committed prefix, e2e_latency = 0.01 per call)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest
from scripted_backend import ScriptedBackend, default_logprob

import sprig as sgl
from sprig import meta
from sprig.cost import Cost
from sprig.meta.refinement import CRITIQUE

PROMPT = "Q: 6*7?\n"


def per_text_counter():
    """Replies '1', '2', ... to successive requests with the same text (thread-safe)."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def reply(text: str, params) -> str:
        with lock:
            counts[text] += 1
            return str(counts[text])

    return reply


def test_best_of_n_by_mean_logprob_with_cost() -> None:
    replies = ["forty-two", "42", "6*7 is 42"]
    backend = ScriptedBackend(list(replies))
    result = meta.best_of_n(PROMPT, 3, backend=backend, max_tokens=16)

    def mean_lp(out: str) -> float:
        return sum(default_logprob(PROMPT + out[:i], ch) for i, ch in enumerate(out)) / len(out)

    assert sorted(c.text for c in result.candidates) == sorted(replies)
    assert result.answer == max(replies, key=mean_lp)
    assert result.score == pytest.approx(mean_lp(result.answer))
    assert backend.kinds() == ["commit", "generate", "generate", "generate"]
    assert all(c.params.return_logprob for c in backend.calls[1:])
    n = len(PROMPT)
    assert result.cost.calls == 4
    assert result.cost.prompt_tokens == 4 * n
    assert result.cost.cached_tokens == 3 * n  # every branch reuses the committed prompt
    assert result.cost.completion_tokens == sum(map(len, replies))
    assert result.cost.latency_s == pytest.approx(0.04)
    assert result.cost.wall_s > 0


def test_best_of_n_with_a_user_scorer() -> None:
    backend = ScriptedBackend(["a", "abc", "ab"])
    result = meta.best_of_n(PROMPT, 3, scorer=len, backend=backend)
    assert (result.answer, result.score) == ("abc", 3)
    assert not any(c.params.return_logprob for c in backend.calls[1:])


def test_self_consistency_votes_over_extracted_answers() -> None:
    replies = ["6*7=42\nAnswer: 42", "Answer: 41", "so\nAnswer: 42.", "I am not sure"]
    backend = ScriptedBackend(list(replies))
    vote = meta.self_consistency(PROMPT, 4, backend=backend)
    assert vote.answer == "42"
    assert vote.votes == {"42": 2, "41": 1}
    assert sorted(vote.samples) == sorted(replies)
    assert sorted(vote.answers, key=str) == sorted(["42", "41", "42", None], key=str)
    assert vote.cost.calls == 5 and vote.cost.completion_tokens == sum(map(len, replies))


def test_answer_extraction_and_majority_ties() -> None:
    assert meta.extract_answer("Answer: 1\nthinking\nAnswer: 7.\n") == "7"
    assert meta.extract_answer("no final line") is None
    assert meta.answer_extractor(r"#### (\d+)")("work\n#### 12") == "12"
    assert meta.majority(("b", None, "a", "a", "b")) == "b"  # tie: first seen
    assert meta.majority((None, None)) is None


def test_tree_search_keeps_the_best_beam() -> None:
    backend = ScriptedBackend(per_text_counter())
    scored_paths = []

    def value(steps: tuple[str, ...]) -> tuple[float, Cost]:
        scored_paths.append(steps)
        return float(sum(map(int, steps))), Cost(calls=1, prompt_tokens=10)

    result = meta.tree_search(PROMPT, value, expand=3, beam=2, depth=2, backend=backend)
    assert result.best.steps == ("3", "3") and result.best.value == 6
    assert result.answer == "3\n3\n"
    assert len(result.scored) == 3 + 2 * 3 == len(scored_paths)
    expanded = {c.prompt.text for c in backend.calls if c.kind == "commit"}
    assert expanded == {PROMPT, PROMPT + "3\n", PROMPT + "2\n"}  # the kept beam
    assert all(c.params.stop == ("\n",) for c in backend.calls if c.kind == "generate")
    model_calls = 3 * (1 + 3)  # three expansions, each a commit plus three steps
    assert result.cost.calls == model_calls + 9
    assert result.cost.prompt_tokens == (
        sum(len(c.prompt.text) for c in backend.calls) + 9 * 10
    )


def test_tree_search_sets_final_paths_aside() -> None:
    backend = ScriptedBackend(per_text_counter())
    result = meta.tree_search(
        PROMPT, lambda steps: float(sum(map(int, steps))), expand=3, beam=2, depth=2,
        is_final=lambda steps: steps[-1] == "3", backend=backend,
    )
    assert result.best.steps == ("2", "3")
    assert {c.prompt.text for c in backend.calls if c.kind == "commit"} == {PROMPT, PROMPT + "2\n", PROMPT + "1\n"}


def test_refine_drafts_critiques_and_revises_in_one_conversation() -> None:
    backend = ScriptedBackend(["draft", "too short", "better draft", "LGTM", "unused"])
    result = meta.refine("Write a haiku.", rounds=3, is_done=lambda c: c == "LGTM", backend=backend,
                         max_tokens=32)
    assert result.answer == "better draft"
    assert result.drafts == ("draft", "better draft")
    assert result.critiques == ("too short", "LGTM")
    texts = [c.prompt.text for c in backend.calls]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert texts[1].endswith("ASSISTANT:draft\nUSER:" + CRITIQUE + "\nASSISTANT:")
    assert result.cost.calls == 4
    assert result.cost.prompt_tokens == sum(map(len, texts))
    assert result.cost.completion_tokens == len("drafttoo shortbetter draftLGTM")


def test_cost_adds_up() -> None:
    a = Cost(calls=1, prompt_tokens=10, cached_tokens=4, completion_tokens=2, latency_s=0.5, wall_s=0.5)
    b = Cost.of_call([{"prompt_tokens": 3, "cached_tokens": 3, "completion_tokens": 1, "e2e_latency": 0.2},
                      {"prompt_tokens": 5, "completion_tokens": 0, "e2e_latency": 0.3}], waited_s=9.0)
    assert b == Cost(calls=1, prompt_tokens=8, cached_tokens=3, completion_tokens=1, latency_s=0.3, wall_s=0.3)
    assert a + b == Cost(calls=2, prompt_tokens=18, cached_tokens=7, completion_tokens=3, latency_s=0.8,
                         wall_s=0.8)
    assert meta.total([a, b, Cost()]) == a + b
    assert (a + b).cache_hit_rate == pytest.approx(7 / 18)
    assert Cost.of_call({"prompt_tokens": 1}, waited_s=0.25).latency_s == 0.25
    assert sgl.Cost is meta.Cost


def test_cost_counts_what_speculation_reports() -> None:
    spec = {"completion_tokens": 9, "spec_verify_ct": 4, "spec_num_proposed_drafts": 10, "spec_num_correct_drafts": 4}
    one = Cost.of_call([spec, {"completion_tokens": 3}], waited_s=1.0)  # a prompt that finished without drafting
    assert (one.verify_passes, one.drafts_proposed, one.drafts_accepted) == (4, 10, 4)
    both = one + Cost.of_call(spec | {"spec_num_correct_drafts": 6}, waited_s=1.0)
    assert (both.verify_passes, both.drafts_proposed, both.drafts_accepted) == (8, 20, 10)
    assert both.draft_accept_rate == 0.5 and Cost().draft_accept_rate == 0.0
    assert str(both).endswith("; speculation: 8 decode passes, 10 of 20 drafts kept (50%)")
    assert str(Cost(verify_passes=3)).endswith("; speculation: 3 decode passes, nothing drafted")
    assert str(Cost(calls=2, prompt_tokens=1200, cached_tokens=7, completion_tokens=3, latency_s=1.5, wall_s=1)) == (
        "2 calls: 1,200 prompt tokens (7 cached), 3 completion tokens; 1.50 s of latency in 1.00 s wall")


def test_cost_counts_retractions() -> None:
    retracted = Cost.of_call([{"completion_tokens": 5, "num_retractions": 2}, {"completion_tokens": 3}], waited_s=1.0)
    assert retracted.retractions == 2
    assert (retracted + Cost.of_call({"num_retractions": 1}, waited_s=1.0)).retractions == 3
    assert str(retracted).endswith("1.00 s wall; 2 retractions to free KV slots")
    assert str(Cost(retractions=1)).endswith("; 1 retraction to free KV slots")
    assert "retraction" not in str(Cost(calls=1))


@pytest.mark.parametrize("strategy", ["best_of_n", "self_consistency", "tree_search"])
def test_sampling_parameters_reach_every_generation(strategy: str) -> None:
    backend = ScriptedBackend(lambda text, params: "Answer: 4")
    if strategy == "tree_search":
        meta.tree_search(PROMPT, lambda steps: 1.0, expand=2, beam=1, depth=1, backend=backend,
                         temperature=0.6, top_p=0.85)
    else:
        getattr(meta, strategy)(PROMPT, 3, backend=backend, temperature=0.6, top_p=0.85)
    gens = [c.params for c in backend.calls if c.kind == "generate"]
    assert gens and all((p.temperature, p.top_p) == (0.6, 0.85) for p in gens)


@pytest.mark.parametrize("strategy", ["best_of_n", "self_consistency"])
def test_a_seed_gives_sample_i_the_seed_plus_i(strategy: str) -> None:
    backend = ScriptedBackend(lambda text, params: "Answer: 4")
    getattr(meta, strategy)(PROMPT, 4, backend=backend, seed=100)
    assert sorted(c.params.seed for c in backend.calls if c.kind == "generate") == [100, 101, 102, 103]
    unseeded = ScriptedBackend(lambda text, params: "Answer: 4")
    getattr(meta, strategy)(PROMPT, 2, backend=unseeded)
    assert [c.params.seed for c in unseeded.calls if c.kind == "generate"] == [None, None]


def test_a_seeded_tree_search_gives_every_step_its_own_seed() -> None:
    backend = ScriptedBackend(per_text_counter())
    meta.tree_search(PROMPT, lambda steps: float(sum(map(int, steps))), expand=3, beam=2, depth=3,
                     backend=backend, seed=50)
    seeds = [c.params.seed for c in backend.calls if c.kind == "generate"]
    assert len(seeds) == 3 + 2 * 3 + 2 * 3 == len(set(seeds))
    assert min(seeds) == 50
