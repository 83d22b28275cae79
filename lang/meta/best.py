"""Best-of-N: sample N answers, keep the one a scorer likes best."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.cost import Cost
from sprig.meta.common import Prompt, Scored, mean_output_logprob, sample, stopwatch


@dataclass(frozen=True)
class BestOfN:
    """The best candidate (`answer`, `score`), every candidate in sampling order, and
    the cost of sampling them (scoring with a user scorer is not a model call)."""

    answer: str
    score: float
    candidates: tuple[Scored, ...]
    cost: Cost


def best_of_n(
    prompt: Prompt,
    n: int,
    *,
    scorer: Callable[[str], float] | None = None,
    backend: Any = None,
    max_tokens: int = 256,
    temperature: float = 0.8,
    top_p: float = 1.0,
    stop: str | list[str] | None = None,
    seed: int | None = None,
) -> BestOfN:
    """Sample `n` continuations of `prompt` (one fork: the prompt is prefilled once) and
    return the highest-scoring; ties go to the earliest. Without `scorer` a candidate's
    score is its mean token logprob. With `seed`, candidate i samples with seed `seed + i`."""
    with stopwatch() as elapsed:
        samples = sample(prompt, n, backend=backend, max_tokens=max_tokens, temperature=temperature,
                         top_p=top_p, stop=stop, seed=seed, return_logprob=scorer is None)
        scores = [scorer(t) if scorer else mean_output_logprob(m) for t, m in zip(samples.texts, samples.metas, strict=True)]
    candidates = tuple(Scored(t, s) for t, s in zip(samples.texts, scores, strict=True))
    best = max(candidates, key=lambda c: c.score)
    return BestOfN(best.text, best.score, candidates, samples.cost.with_wall(elapsed[0]))
