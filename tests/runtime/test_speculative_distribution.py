"""At temperature > 0 speculation leaves the output distribution unchanged: unseeded
samples of the first tokens with speculation (drafts from a drafter whose proposals are
far from the model's distribution) and without come from the same law.

The model's distribution is restricted to a tiny vocabulary by top_k = 3, so four tokens
fall in at most 81 sequences. A chi-square test of homogeneity on those sequences (cells
with fewer than 10 samples pooled into one) rejects at p < 1e-3: one false alarm in a
thousand runs of a correct engine. A broken acceptance rule (every draft kept) is
caught by the same test, so the test can fail.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from draft_checkpoints import truncated_draft

import sprig.runtime.speculative.decode as decode
from sprig.runtime import Engine
from sprig.runtime.speculative.drafter import ContextDrafts

SAMPLES = 1500
PROMPT = [5, 6, 7, 8]
PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_k": 3, "ignore_eos": True}
ALPHA = 1e-3


class UniformDrafter:
    """Drafts (and a token tree's other paths) drawn uniformly from a fixed set of tokens:
    q is far from p."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = sorted(tokens)
        self.rng = random.Random(1)

    def propose(self, context, k: int) -> list[int]:
        return [self.rng.choice(self.tokens) for _ in range(k)]

    def alternatives(self, context, k: int, width: int) -> list[list[int]]:
        """As many other paths, as random: token trees whose every path is far from p."""
        return [self.propose(context, k) for _ in range(width)]


def _samples(path: Path, drafter_tokens: list[int] | None, **options) -> tuple[Counter, decode.SpeculativeStats | None]:
    if drafter_tokens is not None:
        options = {"speculative_algorithm": "ngram", "speculative_pass_costs": "1,0,0,0,0,0,0"}
    with Engine(path, dtype="float32", max_running_requests=64, **options) as engine:
        if drafter_tokens is not None:
            engine.scheduler.speculative.drafter = ContextDrafts(UniformDrafter(drafter_tokens))
        outs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=PARAMS)
        spec = engine.scheduler.speculative
        return Counter(tuple(o["output_ids"]) for o in outs), spec.stats if spec else None


def homogeneity_p_value(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples share one law over their cells (cells with fewer
    than 10 pooled samples merged)."""
    cells = set(a) | set(b)
    small = [c for c in cells if a[c] + b[c] < 10]
    rows = [(a[c], b[c]) for c in cells if a[c] + b[c] >= 10]
    rows.append((sum(a[c] for c in small), sum(b[c] for c in small)))
    rows = [r for r in rows if sum(r) > 0]
    na, nb = sum(r[0] for r in rows), sum(r[1] for r in rows)
    stat = 0.0
    for x, y in rows:
        pooled = (x + y) / (na + nb)
        stat += (x - na * pooled) ** 2 / (na * pooled) + (y - nb * pooled) ** 2 / (nb * pooled)
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> Counter:
    return _samples(tiny_llama, None)[0]


def _tokens(counts: Counter) -> list[int]:
    return sorted({t for seq in counts for t in seq})


def test_speculation_keeps_the_distribution(tiny_llama: Path, plain: Counter) -> None:
    spec, stats = _samples(tiny_llama, _tokens(plain))
    assert 0 < stats.accepted < stats.drafted  # drafts were both kept and rejected
    assert stats.alternatives_kept > 0  # and the walk over token trees left the draft for other paths
    assert homogeneity_p_value(plain, spec) > ALPHA


def test_a_draft_model_keeps_the_distribution(tiny_llama: Path, plain: Counter) -> None:
    """The draft model proposes its argmax, which the target's samples often differ from."""
    spec, stats = _samples(tiny_llama, None, speculative_algorithm="draft", speculative_pass_costs="1,0,0,0,0,0,0",
                           speculative_draft_model_path=str(truncated_draft(tiny_llama)))
    assert 0 < stats.accepted < stats.drafted
    assert homogeneity_p_value(plain, spec) > ALPHA


def test_radix_token_trees_keep_the_distribution(tiny_llama: Path, plain: Counter) -> None:
    """The radix drafter over earlier samples' continuations: paths of a token tree are
    verified beside the drafts and followed where the target's sample took them."""
    spec, stats = _samples(tiny_llama, None, speculative_algorithm="radix", speculative_pass_costs="1,0,0,0,0,0,0")
    assert stats.alternatives_kept > 0 and 0 < stats.accepted < stats.drafted
    assert homogeneity_p_value(plain, spec) > ALPHA


def test_a_broken_acceptance_rule_is_caught(tiny_llama: Path, plain: Counter, monkeypatch) -> None:
    # keeps every draft of the first path, whatever the target drew
    monkeypatch.setattr(decode, "tree_walk", lambda paths, target: [(0, j) for j in range(len(paths[0]) + 1)])
    spec, _ = _samples(tiny_llama, _tokens(plain))
    assert homogeneity_p_value(plain, spec) < ALPHA
