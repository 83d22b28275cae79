"""The demo model's training mixture: every task, its generator and its share.

`take(split, n, seed)` interleaves the tasks' streams in proportion to their weights,
deterministically (and can leave some tasks out of its later part); `take_task` draws
from one task alone (held-out evaluation). The arithmetic task keeps its own stream
(`tasks.problems`), so its held-out problems are the ones the meta-generation experiment
solves.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sprig.runtime.demo import tasks
from sprig.runtime.demo.chat_tasks import make_chat_dialogue
from sprig.runtime.demo.dialogue import Dialogue, assistant, stream, user
from sprig.runtime.demo.extraction import make_extraction_dialogue
from sprig.runtime.demo.facts import make_facts_dialogue, make_facts_training_dialogue
from sprig.runtime.demo.tool_tasks import make_tool_dialogue


@dataclass(frozen=True)
class Task:
    weight: float  # share of the training dialogues
    make: Callable[[random.Random], Dialogue] | None  # None: the arithmetic problems' own stream
    train_make: Callable[[random.Random], Dialogue] | None = None  # the train split's, where not `make`


TASKS = {
    "arithmetic": Task(0.17, None),
    "tools": Task(0.07, make_tool_dialogue),
    "json": Task(0.24, make_extraction_dialogue),
    "few-shot": Task(0.39, make_facts_dialogue, make_facts_training_dialogue),
    "multi-turn": Task(0.13, make_chat_dialogue),
}


def arithmetic_dialogue(problem: tasks.Problem) -> Dialogue:
    return Dialogue("arithmetic", (user(problem.question), assistant(problem.solution)), f"Answer: {problem.answer}")


def task_stream(name: str, split: tasks.Split, seed: int) -> Iterator[Dialogue]:
    """One task's endless, deterministic stream of distinct dialogues (the train split's
    from the task's `train_make` where it has one)."""
    task = TASKS[name]
    make = task.train_make if split == "train" and task.train_make is not None else task.make
    if make is None:
        return (arithmetic_dialogue(p) for p in tasks.problems(split, seed))
    return stream(make, split, seed, name)


def take_task(name: str, split: tasks.Split, n: int, seed: int = 0) -> list[Dialogue]:
    """The first `n` dialogues of one task."""
    it = task_stream(name, split, seed)
    return [next(it) for _ in range(n)]


def take(split: tasks.Split, n: int, seed: int = 0, *, without: frozenset[str] = frozenset(),
         from_: int = 0) -> list[Dialogue]:
    """`n` dialogues of every task, each task's share its weight, in a seeded order. From
    the `from_`-th dialogue on, the tasks in `without` are left out (the others keep their
    relative weights), so the first `from_` are the plain mixture's first `from_`; no
    dialogue repeats (each task's stream goes on where it stood)."""
    if not set(without) < set(TASKS):
        raise ValueError(f"without must name some of the tasks {', '.join(TASKS)}, not all: {sorted(without)}")
    rng = random.Random(f"mixture-{split}-{seed}")
    streams = {name: task_stream(name, split, seed) for name in TASKS}
    first = min(max(from_, 0), n)
    names = rng.choices(list(TASKS), weights=[t.weight for t in TASKS.values()], k=first)
    names += rng.choices(list(TASKS), weights=[0.0 if name in without else t.weight for name, t in TASKS.items()],
                         k=n - first)
    return [next(streams[name]) for name in names]
