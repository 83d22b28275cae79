"""Self-consistency: sample N chains of thought, extract each final answer, vote.

    python examples/self_consistency.py [-n 8] [--seed S] [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig
from sprig.meta import answer_extractor, self_consistency

QUESTION = "Gus has 20 stamps. Then Gus gives away 8. Then Gus doubles them. How many stamps does Gus have now?"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("-n", type=int, default=8, help="samples to draw (default: 8)")
    p.add_argument("--seed", type=int, help="sample i uses seed S + i: the same output every run "
                   "(default: unseeded)")
    args = p.parse_args()
    with backend(args):
        vote = self_consistency(
            sprig.user(QUESTION) + sprig.assistant_begin(), args.n,
            extract=answer_extractor(r"Answer:\s*(-?\d+)"), max_tokens=160, temperature=0.6,
            top_p=0.9, seed=args.seed,
        )
    print(f"answers sampled: {list(vote.answers)}")
    print(f"votes: {vote.votes}")
    print(f"majority answer: {vote.answer}")
    print(f"cost: {vote.cost}")


if __name__ == "__main__":
    main()
