"""Pieces the meta-generation strategies share: sampling N continuations of a prompt
through one fork, scores from output logprobs, and timing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sprig.api import gen
from sprig.cost import Cost
from sprig.ir import Expr
from sprig.program import function

Prompt = str | Expr  # what a strategy appends before generating: text, or e.g. user(q) + assistant_begin()


@dataclass(frozen=True)
class Scored:
    """A candidate text and its score (higher is better)."""

    text: str
    score: float


@dataclass(frozen=True)
class Samples:
    """N sampled continuations of one prompt, their meta_info, and what they cost."""

    texts: tuple[str, ...]
    metas: tuple[dict[str, Any], ...]
    cost: Cost


@function
def _fork_and_generate(s, prompt: Prompt, n: int, seed: int | None,
                       gen_kwargs: dict[str, Any]) -> tuple[list[str], list[Any]]:
    s += prompt
    forks = s.fork(n)
    forks += lambda i: gen("sample", seed=None if seed is None else seed + i, **gen_kwargs)
    texts = [f["sample"] for f in forks]
    metas = [f.get_meta_info("sample") for f in forks]
    forks.join()
    return texts, metas


def sample(prompt: Prompt, n: int, *, seed: int | None = None, backend: Any = None,
           **gen_kwargs: Any) -> Samples:
    """`n` continuations of `prompt`: the prompt is committed once, then `n` forks each
    generate with `gen_kwargs` (gen's arguments: max_tokens, temperature, stop, ...).

    With `seed`, fork i samples with seed `seed + i`: the samples are reproducible, and
    the first k of a call with n > k are the samples of the same call with n = k."""
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}")
    state = _fork_and_generate.run(prompt=prompt, n=n, seed=seed, gen_kwargs=gen_kwargs, backend=backend)
    texts, metas = state.ret_value
    return Samples(tuple(texts), tuple(metas), state.cost())


def mean_output_logprob(meta: dict[str, Any]) -> float:
    """Mean logprob of a generation's tokens, from `output_token_logprobs`."""
    values = [e[0] for e in meta.get("output_token_logprobs") or [] if e[0] is not None]
    if not values:
        raise ValueError("no output_token_logprobs in meta_info: generate with return_logprob=True")
    return sum(values) / len(values)


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """`with stopwatch() as elapsed:` — `elapsed[0]` holds the seconds once the block ends."""
    elapsed = [0.0]
    start = time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed[0] = time.perf_counter() - start
