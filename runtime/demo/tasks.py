"""The demo model's synthetic task: multi-step arithmetic word problems.

A problem starts a person with some items and applies 1–4 operations (buy, give away,
double, triple, share equally); the solution works through each operation with one or two
equations and ends with an `Answer: N` line. Every intermediate value stays in
[0, MAX_VALUE].

An operation can be worked in several equally valid ways, drawn at random per step: adding
or taking away a two-digit number directly, tens first, or units first; doubling as `* 2` or
as a sum; tripling as `* 3` or as a double plus one more. A problem therefore has several
correct solutions whose mistakes differ, the property self-consistency voting relies on:
different reasoning paths that agree on the right answer and scatter on wrong ones.

Problems are split into train and held-out sets by a stable hash of the question text,
so the two sets can never share a question however many problems are drawn.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "heldout"]

MAX_VALUE = 159
STEP_MAX = 45  # most items bought or given away in one step
HELDOUT_BUCKETS = 10  # one hash bucket in this many is held out
_NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana"]
_NAMES += ["Ivan", "Jo", "Kim", "Leo", "Mia", "Ned", "Omar", "Pia"]
_ITEMS = ["apples", "books", "coins", "marbles", "pens", "stamps", "cards", "shells"]
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class Step:
    """One operation of a problem: its sentence, worked equations, the value after it, and
    the operation as a calculator would run it (`add`, `subtract`, `multiply`, `divide`
    the running value by `operand`)."""

    sentence: str
    equations: tuple[str, ...]
    value: int
    op: str
    operand: int


@dataclass(frozen=True)
class Problem:
    """One word problem: the question, its worked solution, and the integer answer; `name`,
    `item`, `start` and `steps` are what the question was built from."""

    question: str
    solution: str
    answer: int
    name: str = ""
    item: str = ""
    start: int = 0
    steps: tuple[Step, ...] = ()

    def messages(self) -> list[dict[str, str]]:
        """The problem as a chat: the user asks, the assistant solves."""
        return [
            {"role": "user", "content": self.question},
            {"role": "assistant", "content": self.solution},
        ]


def _add(rng: random.Random, value: int, n: int, sign: int) -> list[str]:
    """Equations adding (sign 1) or taking away (sign -1) `n`: directly, tens first, or units first."""
    op = "+" if sign > 0 else "-"
    tens, units = n - n % 10, n % 10
    parts = [[n]]
    if tens and units:
        parts += [[tens, units], [units, tens]]
    equations = []
    for part in rng.choice(parts):
        equations.append(f"{value} {op} {part} = {value + sign * part}")
        value += sign * part
    return equations


def _multiply(rng: random.Random, value: int, k: int) -> list[str]:
    """Equations multiplying by 2 or 3: as a product, or as a sum."""
    if rng.random() < 0.5:
        return [f"{value} * {k} = {value * k}"]
    if k == 2:
        return [f"{value} + {value} = {2 * value}"]
    return [f"{value} * 2 = {2 * value}", f"{2 * value} + {value} = {3 * value}"]


def step(rng: random.Random, value: int) -> Step:
    """Pick one operation valid for `value` (at least 1) and work it."""
    while True:
        op = rng.choice(["buy", "buy", "give", "give", "double", "triple", "share"])
        if op == "buy" and value < MAX_VALUE:
            n = rng.randint(1, min(STEP_MAX, MAX_VALUE - value))
            return Step(f"buys {n} more", tuple(_add(rng, value, n, 1)), value + n, "add", n)
        if op == "give" and value > 1:
            n = rng.randint(1, min(STEP_MAX, value - 1))
            return Step(f"gives away {n}", tuple(_add(rng, value, n, -1)), value - n, "subtract", n)
        if op in ("double", "triple"):
            k = 2 if op == "double" else 3
            if 0 < value * k <= MAX_VALUE:
                return Step(f"{op}s them", tuple(_multiply(rng, value, k)), value * k, "multiply", k)
        if op == "share":
            ks = [k for k in (2, 3, 4, 5) if value % k == 0 and value // k > 0]
            if ks:
                k = rng.choice(ks)
                return Step(
                    f"shares them equally with {k - 1} friends and keeps one share",
                    (f"{value} / {k} = {value // k}",),
                    value // k,
                    "divide",
                    k,
                )


def make_problem(rng: random.Random, max_steps: int = 4) -> Problem:
    """Draw one problem with 1–`max_steps` steps from `rng`."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    start = value = rng.randint(2, 60)
    steps = []
    for _ in range(rng.randint(1, max_steps)):
        steps.append(step(rng, value))
        value = steps[-1].value
    question = " ".join(
        [f"{name} has {start} {item}.", *(f"Then {name} {s.sentence}." for s in steps),
         f"How many {item} does {name} have now?"]
    )
    solution = "\n".join([*(e for s in steps for e in s.equations), f"Answer: {value}"])
    return Problem(question, solution, value, name, item, start, tuple(steps))


def split_of(question: str) -> Split:
    """The split a question belongs to, from a stable hash of its text."""
    digest = hashlib.sha256(question.encode()).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") % HELDOUT_BUCKETS == 0 else "train"


def problems(split: Split, seed: int) -> Iterator[Problem]:
    """An endless, deterministic stream of distinct problems of one split."""
    rng = random.Random(f"{split}-{seed}")
    seen: set[str] = set()
    while True:
        p = make_problem(rng)
        if p.question not in seen and split_of(p.question) == split:
            seen.add(p.question)
            yield p


def take(split: Split, n: int, seed: int = 0) -> list[Problem]:
    """The first `n` problems of `split` for `seed`."""
    stream = problems(split, seed)
    return [next(stream) for _ in range(n)]


def extract_answer(text: str) -> int | None:
    """The integer on the text's final `Answer: N` line, or None if it has none."""
    m = _ANSWER_RE.search(text.strip())
    return int(m.group(1)) if m else None
