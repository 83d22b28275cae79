"""Iterative refinement: draft, then `rounds` of critique and revision, as one chat.

The conversation is one program state, so each turn extends the previous prefix and a
prefix cache serves it; `is_done(critique)` may end the loop early.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sprig.api import assistant, gen, user
from sprig.cost import Cost
from sprig.meta.common import stopwatch
from sprig.program import function

CRITIQUE = "Critique your answer above: list concrete mistakes or omissions. Be brief."
REVISE = "Rewrite your answer, fixing every issue in the critique. Reply with the answer only."


@dataclass(frozen=True)
class Refinement:
    """The final answer, every draft (the first, then each revision), every critique,
    and the cost of the whole conversation."""

    answer: str
    drafts: tuple[str, ...]
    critiques: tuple[str, ...]
    cost: Cost


@function
def _refine(s, task: str, rounds: int, critique: str, revise: str,
            is_done: Callable[[str], bool] | None, gen_kwargs: dict[str, Any]) -> tuple[list[str], list[str]]:
    s += user(task)
    s += assistant(gen("draft_0", **gen_kwargs))
    drafts, critiques = [s["draft_0"]], []
    for r in range(rounds):
        s += user(critique)
        s += assistant(gen(f"critique_{r}", **gen_kwargs))
        critiques.append(s[f"critique_{r}"])
        if is_done is not None and is_done(critiques[-1]):
            break
        s += user(revise)
        s += assistant(gen(f"draft_{r + 1}", **gen_kwargs))
        drafts.append(s[f"draft_{r + 1}"])
    return drafts, critiques


def refine(
    task: str,
    *,
    rounds: int = 2,
    critique_prompt: str = CRITIQUE,
    revise_prompt: str = REVISE,
    is_done: Callable[[str], bool] | None = None,
    backend: Any = None,
    max_tokens: int = 512,
    temperature: float = 0.7,
) -> Refinement:
    """Draft an answer to `task`, then up to `rounds` times critique and revise it."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0; got {rounds}")
    gen_kwargs = {"max_tokens": max_tokens, "temperature": temperature}
    with stopwatch() as elapsed:
        state = _refine.run(task=task, rounds=rounds, critique=critique_prompt, revise=revise_prompt,
                            is_done=is_done, gen_kwargs=gen_kwargs, backend=backend)
        drafts, critiques = state.ret_value
    return Refinement(drafts[-1], tuple(drafts), tuple(critiques), state.cost().with_wall(elapsed[0]))
