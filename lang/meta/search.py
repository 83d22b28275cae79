"""Step-wise beam search over reasoning steps (Tree-of-Thoughts style).

Each round expands every open path by `expand` sampled next steps (one fork per path,
so each path's prefix is prefilled once and the paths run concurrently), scores every
new path with `value_fn`, and keeps the best `beam`. A path that `is_final` accepts is
set aside as finished. The search stops after `depth` rounds or when no path is open;
the answer is the best path found, finished or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sprig.api import gen
from sprig.cost import Cost, total
from sprig.meta.common import Prompt, stopwatch
from sprig.program import function

ValueFn = Callable[[tuple[str, ...]], float | tuple[float, Cost]]


@dataclass(frozen=True)
class Path:
    """A sequence of steps and its value (higher is better)."""

    steps: tuple[str, ...]
    value: float

    def text(self, separator: str) -> str:
        return "".join(step + separator for step in self.steps)


@dataclass(frozen=True)
class SearchResult:
    """The best path (`answer` is its steps joined), every path scored, and the cost:
    model calls of the search plus whatever `value_fn` reported."""

    answer: str
    best: Path
    scored: tuple[Path, ...]
    cost: Cost


@function
def _expand(s, prompt: Prompt, path: str, k: int, seed: int | None,
            gen_kwargs: dict[str, Any]) -> list[str]:
    s += prompt
    s += path
    forks = s.fork(k)
    forks += lambda i: gen("step", seed=None if seed is None else seed + i, **gen_kwargs)
    forks.join()
    return s["step"]


def _value(value_fn: ValueFn, steps: tuple[str, ...]) -> tuple[float, Cost]:
    result = value_fn(steps)
    return result if isinstance(result, tuple) else (float(result), Cost())


def tree_search(
    prompt: Prompt,
    value_fn: ValueFn,
    *,
    expand: int = 3,
    beam: int = 2,
    depth: int = 3,
    separator: str = "\n",
    is_final: Callable[[tuple[str, ...]], bool] | None = None,
    backend: Any = None,
    max_step_tokens: int = 128,
    temperature: float = 0.8,
    top_p: float = 1.0,
    seed: int | None = None,
) -> SearchResult:
    """Beam search (see the module docstring). `value_fn(steps)` returns a float, or a
    `(float, Cost)` when it calls a model itself. Steps end at `separator`, which joins
    them back into the text the next step continues. With `seed`, every sampled step has
    its own seed from `seed` on, so the whole search is reproducible."""
    if min(expand, beam, depth) < 1:
        raise ValueError("expand, beam and depth must be >= 1")
    gen_kwargs = {"stop": separator, "max_tokens": max_step_tokens, "temperature": temperature, "top_p": top_p}
    open_paths: Sequence[Path] = [Path((), 0.0)]
    finished: list[Path] = []
    scored: list[Path] = []
    costs: list[Cost] = []
    with stopwatch() as elapsed:
        for round_ in range(depth):
            states = _expand.run_batch(
                [{"prompt": prompt, "path": p.text(separator), "k": expand, "gen_kwargs": gen_kwargs,
                  "seed": None if seed is None else seed + (round_ * beam + j) * expand}
                 for j, p in enumerate(open_paths)],
                backend=backend, num_threads=len(open_paths),
            )
            costs += [s.cost() for s in states]
            children = []
            for parent, state in zip(open_paths, states, strict=True):
                for step in state.ret_value:
                    steps = (*parent.steps, step)
                    value, cost = _value(value_fn, steps)
                    costs.append(cost)
                    children.append(Path(steps, value))
            scored += children
            ranked = sorted(children, key=lambda p: p.value, reverse=True)
            done = [p for p in ranked if is_final is not None and is_final(p.steps)]
            finished += done
            open_paths = [p for p in ranked if p not in done][:beam]
            if not open_paths:
                break
    best = max([*finished, *open_paths], key=lambda p: p.value)
    return SearchResult(best.text(separator), best, tuple(scored), total(costs).with_wall(elapsed[0]))

