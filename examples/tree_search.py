"""Tree search over reasoning steps: expand each partial solution with sampled next steps,
score every step with a verifier, keep the best beam (Tree-of-Thoughts style).

The value function checks the arithmetic of each `a op b = c` step and rewards reaching
an `Answer:` line, so the search prefers chains whose steps are right.

    python examples/tree_search.py [--url URL | --model PATH]
"""

from __future__ import annotations

import re

from _backend import backend, parser

import sprig
from sprig.meta import tree_search

QUESTION = "Hana has 6 cards. Then Hana triples them. Then Hana gives away 5. How many cards does Hana have now?"
EQUATION = re.compile(r"(-?\d+)\s*([-+*/x×])\s*(-?\d+)\s*=\s*(-?\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "x": lambda a, b: a * b,
       "×": lambda a, b: a * b, "/": lambda a, b: a // b if b else None}


def value(steps: tuple[str, ...]) -> float:
    """Fraction of steps whose equations hold, plus a bonus for a final answer."""
    score = 0.0
    for step in steps:
        eqs = EQUATION.findall(step)
        if eqs:
            score += sum(OPS[op](int(a), int(b)) == int(c) for a, op, b, c in eqs) / len(eqs)
    return score / len(steps) + (0.5 if steps[-1].strip().startswith("Answer:") else 0.0)


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        result = tree_search(
            sprig.user(QUESTION) + sprig.assistant_begin(), value,
            expand=3, beam=2, depth=10, is_final=lambda steps: steps[-1].strip().startswith("Answer:"),
        )
    print("best path:")
    for step in result.best.steps:
        print(f"  {step.strip()}")
    print(f"value {result.best.value:.2f}; {len(result.scored)} paths scored; cost: {result.cost}")


if __name__ == "__main__":
    main()
