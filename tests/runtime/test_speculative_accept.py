"""The acceptance rules against brute-force enumeration, and the drafters on hand-made contexts."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from sprig.radix import RadixCache, SlotAllocator
from sprig.runtime.speculative.accept import (
    accept_probability,
    residual,
    speculative_step,
    tree_walk,
)
from sprig.runtime.speculative.draft_length import EMPTY_PAUSE_STEPS, AcceptanceRate, DraftLength
from sprig.runtime.speculative.ngram import NgramDrafter, occurrences
from sprig.runtime.speculative.radix_drafter import RadixDrafter

CASES = [
    ([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),
    ([0.1, 0.1, 0.8], [0.7, 0.2, 0.1]),
    ([0.2, 0.8], [0.2, 0.8]),  # q == p: nothing is rejected
    ([0.05, 0.6, 0.05, 0.3], [0.0, 0.0, 1.0, 0.0]),  # one-hot q
    ([1.0, 0.0, 0.0], [0.0, 0.5, 0.5]),  # disjoint supports: always rejected
]


def _output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Enumerate every draft x (weight q(x)): accept x with min(1, p/q), else draw the residual."""
    out = torch.zeros_like(p)
    for x in range(p.numel()):
        if q[x] == 0:
            continue
        a = accept_probability(p, q, x)
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual(p, q)
    return out


@pytest.mark.parametrize(("p", "q"), CASES)
def test_rejection_sampling_emits_exactly_p(p: list[float], q: list[float]) -> None:
    pt, qt = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    torch.testing.assert_close(_output_distribution(pt, qt), pt, rtol=0, atol=1e-12)


def test_a_wrong_residual_would_be_caught() -> None:
    """The enumeration can fail: drawing rejections from p itself is biased."""
    p, q = torch.tensor(CASES[1][0], dtype=torch.float64), torch.tensor(CASES[1][1], dtype=torch.float64)
    biased = sum(q[x] * (accept_probability(p, q, x) * torch.eye(3, dtype=torch.float64)[x]
                         + (1 - accept_probability(p, q, x)) * p) for x in range(3))
    assert (biased - p).abs().max() > 0.05


def test_one_hot_coupling_equals_rejection_sampling() -> None:
    """A deterministic draft x: drawing y ~ p and keeping x iff y == x, else emitting y,
    gives the same joint law of (accepted, token) as min(1, p/q) with the residual."""
    p = torch.tensor([0.05, 0.6, 0.05, 0.3], dtype=torch.float64)
    for x in range(4):
        q = torch.nn.functional.one_hot(torch.tensor(x), 4).double()
        a = accept_probability(p, q, x)
        rule = {(True, x): a} | {(False, v): (1 - a) * float(residual(p, q)[v]) for v in range(4) if v != x}
        coupling = {(y == x, y): float(p[y]) for y in range(4)}
        assert rule.keys() == coupling.keys()
        for key, prob in rule.items():
            assert prob == pytest.approx(coupling[key], abs=1e-12)


def test_speculative_step_samples_its_rule() -> None:
    p = torch.tensor([0.1, 0.1, 0.8])
    q = torch.tensor([0.7, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    trials = 20000
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen))
        u = float(torch.rand((), generator=gen))
        noise = torch.empty(3).exponential_(generator=gen)
        counts[speculative_step(p, q, x, uniform=u, noise=noise)[1]] += 1
    # 5 standard deviations of a binomial at n = 20000: false alarm below 1e-5 per token
    sd = (p * (1 - p) / trials).sqrt()
    assert ((counts / trials - p).abs() < 5 * sd).all(), counts / trials


def _walk(paths: list[list[int]], next_token) -> list[int]:
    """The tokens `tree_walk` emits when the target's token after context c is
    `next_token(c)` (c: the tokens after the draft's start)."""
    picks = tree_walk(paths, lambda b, j: next_token(tuple(paths[b][:j])))
    return [next_token(tuple(paths[b][:j])) for b, j in picks]


def test_tree_walk_on_one_path_keeps_the_agreeing_prefix() -> None:
    def walk(targets: list[int], draft: list[int]) -> list[tuple[int, int]]:
        return tree_walk([draft], lambda b, j: targets[j])

    assert walk([1, 2, 3], [1, 2]) == [(0, 0), (0, 1), (0, 2)]  # both kept, then the bonus token
    assert walk([1, 9, 3], [1, 2]) == [(0, 0), (0, 1)]
    assert walk([7], []) == [(0, 0)]
    assert walk([5, 2, 3], [1, 2]) == [(0, 0)]


def test_tree_walk_moves_to_the_path_the_target_took() -> None:
    paths = [[1, 2, 3], [1, 5, 6], [4, 8]]
    target = {(): 1, (1,): 5, (1, 5): 6, (1, 5, 6): 7}
    assert tree_walk(paths, lambda b, j: target[tuple(paths[b][:j])]) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    target = {(): 4, (4,): 8, (4, 8): 9}
    assert _walk(paths, target.__getitem__) == [4, 8, 9]
    target = {(): 1, (1,): 7}
    assert _walk(paths, target.__getitem__) == [1, 7]  # no path has 7 after 1


def _random_target(rng: random.Random) -> Callable[[tuple[int, ...]], int]:
    """A deterministic target over 3 tokens: a random next token per context, drawn once."""
    table: dict[tuple[int, ...], int] = {}
    return lambda c: table.setdefault(c, rng.randrange(3))


def test_tree_walk_emits_what_the_target_would_one_token_at_a_time() -> None:
    """Brute force over random trees and random deterministic targets: the walk emits the
    target's own continuation for as long as some path holds it, then the target's next
    token, reading each at a row whose context is what it emitted before."""
    rng = random.Random(0)
    for _ in range(3000):
        paths = [[rng.randrange(3) for _ in range(rng.randint(0 if i == 0 else 1, 4))] for i in range(rng.randint(1, 4))]
        next_token = _random_target(rng)
        picks = tree_walk(paths, lambda b, j, f=next_token, ps=paths: f(tuple(ps[b][:j])))
        emitted = [next_token(tuple(paths[b][:j])) for b, j in picks]
        assert all(j == i and paths[b][:j] == emitted[:j] for i, (b, j) in enumerate(picks)), (paths, picks)
        expect: list[int] = []
        while True:
            expect.append(next_token(tuple(expect)))
            if not any(p[: len(expect)] == expect for p in paths):
                break
        assert emitted == expect, paths


# ---------------------------------------------------------------- drafters


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    d = NgramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # the latest occurrence
    assert d.propose([1, 2, 3, 4, 5, 1, 2], 5) == [3, 4, 5, 1, 2]
    assert d.propose([7, 8, 9, 8, 1, 2], 3) == []  # no bigram repeats
    assert d.propose([4, 4, 4], 2) == [4]
    assert d.propose([1, 2, 3], 0) == []


def test_ngram_prefers_longer_suffixes() -> None:
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    # the unigram 3 was last followed by 8, the trigram 1 2 3 by 4
    assert d.propose([1, 2, 3, 4, 0, 3, 8, 1, 2, 3], 1) == [4]


def test_ngram_alternatives_are_what_followed_earlier_occurrences() -> None:
    d = NgramDrafter(max_ngram=2, min_ngram=2)
    context = [1, 2, 7, 1, 2, 8, 1, 2, 7, 1, 2]
    assert d.propose(context, 3) == [7, 1, 2]  # the latest occurrence
    assert d.alternatives(context, 3, 3) == [[8, 1, 2]]  # the first occurrence's [7, 1, 2] is the draft again
    assert d.alternatives(context, 1, 3) == [[8]]
    assert d.alternatives([1, 2, 1, 2, 1], 3, 3) == []  # one occurrence


@pytest.mark.parametrize(("seq", "suffix", "hits"), [
    ([302, 302, 223], [302, 302, 223, 302], []),  # a suffix longer than the sequence (the radix
    # drafter matches a context's suffix against a short cached continuation)
    ([5, 6], [5, 6], []),  # an occurrence must end before the sequence does
    ([5, 6, 7, 5, 6], [5, 6], [2]),
    ([5, 5, 5, 5], [5, 5], [2, 3]),
])
def test_occurrences_of_a_suffix(seq: list[int], suffix: list[int], hits: list[int]) -> None:
    got = occurrences(np.array(seq, dtype=np.int32), np.array(suffix, dtype=np.int32))
    assert got.tolist() == hits


def _tree(page: int, seqs: list[list[int]], hits: list[int]) -> RadixCache:
    allocator = SlotAllocator(256, page)
    cache = RadixCache(allocator)
    for seq, n in zip(seqs, hits, strict=True):
        slots = allocator.alloc(len(seq) - len(seq) % page)
        allocator.free(slots[: cache.insert(seq, slots)])  # the shared prefix's duplicates
        for _ in range(n):
            cache.match_prefix(seq)
    return cache


@pytest.mark.parametrize("page", [1, 4])
def test_radix_drafter_follows_the_most_visited_branch(page: int) -> None:
    a = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17]
    b = [1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27]
    cache = _tree(page, [a, b], [1, 3])
    d = RadixDrafter(cache)
    assert d.propose([1, 2, 3, 4], 3) == [20, 21, 22]  # b was visited more
    assert d.propose([1, 2, 3, 4, 10], 3) == [11, 12, 13]  # the context picks a
    assert d.propose([1, 2, 3, 4, 10, 11, 12, 13, 14, 15], 8) == [16, 17]
    assert d.propose([1, 2, 5], 3) == []  # left the tree before any shared node: nothing
    # left a's branch at 99: what followed its latest tokens in the continuations below [1, 2, 3, 4]
    assert d.propose([1, 2, 3, 4, 10, 11, 99, 13, 14], 3) == [15, 16, 17]
    assert d.propose([1, 2, 3, 4, 10, 11, 99, 23, 24], 2) == [25, 26]
    assert d.propose([1, 2, 3, 4, 10, 11, 99, 98], 2) == []
    before = [(n.hit_count, n.last_access) for n in cache.root.children.values()]
    d.propose([1, 2, 3, 4, 10], 3)
    assert before == [(n.hit_count, n.last_access) for n in cache.root.children.values()]
    cache.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
def test_radix_drafter_proposes_the_branches_it_did_not_follow(page: int) -> None:
    a = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17]
    b = [1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27]
    c = [1, 2, 3, 4, 20, 21, 22, 23, 30, 31, 32, 33]
    cache = _tree(page, [a, b, c], [1, 3, 2])
    d = RadixDrafter(cache)
    assert d.propose([1, 2, 3, 4], 6) == [20, 21, 22, 23, 24, 25]  # b, the most visited
    # c leaves b after 4 tokens, a at the first: the branching nearest the context first
    assert d.alternatives([1, 2, 3, 4], 6, 3) == [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 30, 31]]
    assert d.alternatives([1, 2, 3, 4], 6, 1) == [[10, 11, 12, 13, 14, 15]]
    assert d.alternatives([1, 2, 3, 4], 3, 3) == [[10, 11, 12]]  # c leaves b past 3 tokens
    assert d.alternatives([1, 2, 3, 4, 10], 3, 3) == []  # nothing branches below a
    # out of the tree: what followed the latest tokens in other continuations
    assert d.propose([1, 2, 3, 4, 99, 22, 23], 2) == [24, 25]
    assert d.alternatives([1, 2, 3, 4, 99, 22, 23], 2, 3) == [[30, 31]]
    cache.check_integrity()


def test_draft_length_adapts() -> None:
    n = DraftLength(max_len=4)
    assert n.next() == 2  # at the starting rate 0.5 a third draft is kept a time in eight
    n.update(2, 2)
    n.update(4, 4)
    assert n.next() == 4
    n.update(4, 1)
    n.update(2, 0)
    assert n.next() == 2  # rate 0.54
    n.update(1, 0)  # twice nothing: pause, then one draft (rate 0.33)
    assert [n.next() for _ in range(3)] == [0, 0, 1]
    for _ in range(3):
        n.update(1, 1)
    assert n.next() == 4
    assert 0 < n.expected(2) < n.expected(3) < 3


def test_a_drafter_with_nothing_to_propose_is_asked_again_later() -> None:
    n = DraftLength(max_len=4)
    n.empty()
    assert [n.next() for _ in range(EMPTY_PAUSE_STEPS + 1)] == [0] * EMPTY_PAUSE_STEPS + [2]
    assert n.misses == 0  # not a miss: its rate and later pauses are untouched


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.9])
def test_the_acceptance_rate_recovers_the_chance_a_draft_is_kept(alpha: float) -> None:
    """Drafts kept each with chance alpha, checked in order until the first rejection: the
    estimate lands on alpha, where the share of drafts kept (accepted / drafted) does not."""
    rng = np.random.default_rng(0)
    estimate = AcceptanceRate.starting_at(0.5, decay=0.999)
    shares = []
    for _ in range(20000):
        drafted = int(rng.integers(1, 9))
        accepted = next((i for i in range(drafted) if rng.random() >= alpha), drafted)
        estimate.update(drafted, accepted)
        shares.append(accepted / drafted)
    assert abs(estimate.rate - alpha) < 0.03
    assert float(np.mean(shares)) < alpha - 0.1


def test_the_acceptance_rate_counts_checked_drafts() -> None:
    rate = AcceptanceRate.starting_at(0.5, decay=0.0)  # the last verification alone
    rate.update(4, 2)
    assert rate.rate == 2 / 3  # two kept, the third rejected, the fourth never checked
    rate.update(4, 4)
    assert rate.rate == 1.0
    rate.update(3, 0)
    assert rate.rate == 0.0


def test_proposals_are_pure() -> None:
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 5, 200).tolist()
    d = NgramDrafter()
    assert d.propose(ctx, 4) == d.propose(list(ctx), 4)
    for k in range(1, 6):
        assert d.propose(ctx, k) == d.propose(ctx, 8)[:k]


def test_the_config_accepts_every_registered_drafter() -> None:
    """`SchedulerConfig` validates names from its own list (no import of the drafters):
    the list is the registry's keys."""
    from sprig.runtime.scheduler.config import SPECULATIVE_ALGORITHMS
    from sprig.runtime.speculative.drafter import DRAFTERS

    assert set(SPECULATIVE_ALGORITHMS) == set(DRAFTERS)
