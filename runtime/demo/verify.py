"""A process verifier for the demo task: how sound a partial solution is, step by step.

Tree search uses it as its value function. It knows the task's solution forms (see
`tasks`): a chain of `a op b = c` equations from the question's first number, then an
`Answer: N` line, and checks each step against the question, not only its arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sprig.runtime.demo.tasks import extract_answer

EQUATION = re.compile(r"(-?\d+)\s*([-+*/x×])\s*(-?\d+)\s*=\s*(-?\d+)")
_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "x": lambda a, b: a * b,
    "×": lambda a, b: a * b,
    "/": lambda a, b: a // b if b and a % b == 0 else None,
}


def is_answer(step: str) -> bool:
    """Whether `step` is a final `Answer:` line."""
    return step.strip().startswith("Answer:")


def step_value(question: str, steps: Sequence[str]) -> float:
    """The fraction of `steps` that are sound, plus 0.5 when the last one is an `Answer:`
    line stating the value the chain reached: 1.5 for a complete sound solution, 1.0 for
    a sound unfinished one, less for any slip.

    A step is sound when it has equations and each of them holds and continues the chain:
    its left operand is the running value (the question's first number, then each
    equation's result) and its right operand fits the operation: a number the question
    names later, or its tens or its units (added or taken away in parts), for `+` and `-`;
    for `+` also a value the chain has held (a + a; a double plus the original); 2 or 3
    for `*`; one more than a named number for `/` (shared with n friends: n + 1 shares).
    An `Answer:` line is sound when it states the running value.
    """
    named = [int(n) for n in re.findall(r"\d+", question)]
    if not named or not steps:
        return 0.0
    parts = {p for n in named[1:] for p in (n, n - n % 10, n % 10)}
    operands = {"-": parts, "*": {2, 3}, "x": {2, 3}, "×": {2, 3}, "/": {n + 1 for n in named[1:]}}
    value, seen = named[0], {named[0]}
    sound = 0
    for step in steps:
        if is_answer(step):
            sound += int(extract_answer(step) == value)
            continue
        equations = EQUATION.findall(step)
        ok = bool(equations)
        for a, op, b, c in equations:
            a, b, c = int(a), int(b), int(c)
            allowed = parts | seen if op == "+" else operands[op]
            ok = ok and a == value and b in allowed and _OPS[op](a, b) == c
            value = c
            seen.add(c)
        sound += int(ok)
    finished = is_answer(steps[-1]) and extract_answer(steps[-1]) == value
    return sound / len(steps) + (0.5 if finished else 0.0)
