"""Self-consistency: sample N chains of thought, extract each final answer, vote.

    python examples/self_consistency.py [-n 8] [--seed 0] [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, sampling_parser

import sprig
from sprig.meta import answer_extractor, self_consistency

QUESTION = "Mia has 59 stamps. Then Mia gives away 14. Then Mia buys 25 more. How many stamps does Mia have now?"


def main() -> None:
    args = sampling_parser(__doc__).parse_args()
    with backend(args):
        vote = self_consistency(
            sprig.user(QUESTION) + sprig.assistant_begin(), args.n,
            extract=answer_extractor(r"Answer:\s*(-?\d+)"), max_tokens=160, temperature=0.6,
            top_p=0.9, seed=args.seed,
        )
    print(QUESTION)
    print(f"answers sampled: {list(vote.answers)}")
    print(f"votes: {vote.votes}")
    print(f"majority answer: {vote.answer}")
    print(f"cost: {vote.cost}")


if __name__ == "__main__":
    main()
