"""Tree search over reasoning steps: expand each partial solution with sampled next steps,
score every step with a verifier, keep the best beam (Tree-of-Thoughts style).

The value function is the demo task's process verifier (`sprig.runtime.demo.verify`): it
checks that each `a op b = c` step holds and follows from the question and the steps
before it, and rewards an `Answer:` line that states where the chain arrived, so the
search prefers chains whose steps are right.

    python examples/tree_search.py [--seed 0] [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, sampling_parser

import sprig
from sprig.meta import tree_search
from sprig.runtime.demo.verify import is_answer, step_value

QUESTION = ("Mia has 56 stamps. Then Mia gives away 1. Then Mia shares them equally with 4 friends and keeps one "
            "share. Then Mia buys 28 more. How many stamps does Mia have now?")


def value(steps: tuple[str, ...]) -> float:
    return step_value(QUESTION, steps)


def main() -> None:
    args = sampling_parser(__doc__, n=None).parse_args()
    with backend(args):
        result = tree_search(
            sprig.user(QUESTION) + sprig.assistant_begin(), value,
            expand=5, beam=3, depth=10, is_final=lambda steps: is_answer(steps[-1]), seed=args.seed,
        )
    print(f"{QUESTION}\nbest path:")
    for step in result.best.steps:
        print(f"  {step.strip()}")
    print(f"value {result.best.value:.2f}; {len(result.scored)} paths scored; cost: {result.cost}")


if __name__ == "__main__":
    main()
