"""Self-consistency: sample N reasoning chains, extract each one's answer, majority vote."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.cost import Cost
from sprig.meta.common import Prompt, sample, stopwatch

Extractor = Callable[[str], str | None]


def answer_extractor(pattern: str = r"Answer:\s*(.+)") -> Extractor:
    """An extractor that returns group 1 of the LAST line matching `pattern` (searched
    per line), stripped of spaces and a trailing period; None when no line matches."""
    compiled = re.compile(pattern)

    def extract(text: str) -> str | None:
        for line in reversed(text.splitlines()):
            match = compiled.search(line)
            if match:
                return match.group(1).strip().rstrip(".").strip()
        return None

    return extract


extract_answer = answer_extractor()


@dataclass(frozen=True)
class Vote:
    """The majority `answer` (None when no sample had one), the vote counts, every
    sample with its extracted answer, and the cost."""

    answer: str | None
    votes: dict[str, int]
    samples: tuple[str, ...]
    answers: tuple[str | None, ...]
    cost: Cost


def majority(answers: tuple[str | None, ...]) -> str | None:
    """The most common answer that is not None (None if there is none); a tie goes to
    the answer that appears first."""
    votes = Counter(a for a in answers if a is not None)
    return max(votes, key=votes.__getitem__) if votes else None  # first maximum in first-seen order


def self_consistency(
    prompt: Prompt,
    n: int,
    *,
    extract: Extractor = extract_answer,
    backend: Any = None,
    max_tokens: int = 512,
    temperature: float = 0.8,
    top_p: float = 1.0,
    stop: str | list[str] | None = None,
    seed: int | None = None,
) -> Vote:
    """Sample `n` chains (one fork), extract an answer from each, return the most common
    one; a tie goes to the answer that appeared first. With `seed`, sample i samples with
    seed `seed + i`."""
    with stopwatch() as elapsed:
        samples = sample(prompt, n, backend=backend, max_tokens=max_tokens, temperature=temperature,
                         top_p=top_p, stop=stop, seed=seed)
    answers = tuple(extract(t) for t in samples.texts)
    votes = dict(Counter(a for a in answers if a is not None))
    return Vote(majority(answers), votes, samples.texts, answers, samples.cost.with_wall(elapsed[0]))
