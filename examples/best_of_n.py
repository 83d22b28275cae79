"""Best-of-N: sample N chains of thought from one cached prompt, keep the most likely.

    python examples/best_of_n.py [-n 8] [--seed S] [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig
from sprig.meta import best_of_n

QUESTION = "Fay has 12 marbles. Then Fay buys 7 more. Then Fay gives away 5. How many marbles does Fay have now?"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("-n", type=int, default=8, help="samples to draw (default: 8)")
    p.add_argument("--seed", type=int, help="sample i uses seed S + i: the same output every run "
                   "(default: unseeded)")
    args = p.parse_args()
    with backend(args):
        result = best_of_n(sprig.user(QUESTION) + sprig.assistant_begin(), args.n, max_tokens=160,
                           temperature=0.6, top_p=0.9, seed=args.seed)
    for c in result.candidates:
        print(f"[{c.score:7.3f}] {c.text.strip().splitlines()[-1] if c.text.strip() else ''}")
    print(f"\nbest (mean logprob {result.score:.3f}):\n{result.answer}")
    print(f"\ncost: {result.cost}")


if __name__ == "__main__":
    main()
