"""Best-of-N: sample N chains of thought from one cached prompt, keep the most likely.

    python examples/best_of_n.py [-n 8] [--seed 0] [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, sampling_parser

import sprig
from sprig.meta import best_of_n

QUESTION = ("Ben has 25 stamps. Then Ben buys 36 more. Then Ben gives away 27. Then Ben doubles them. "
            "How many stamps does Ben have now?")


def main() -> None:
    args = sampling_parser(__doc__).parse_args()
    with backend(args):
        result = best_of_n(sprig.user(QUESTION) + sprig.assistant_begin(), args.n, max_tokens=160,
                           temperature=0.6, top_p=0.9, seed=args.seed)
    print(f"{QUESTION}\n")
    for c in result.candidates:
        print(f"[{c.score:7.3f}] {c.text.strip().splitlines()[-1] if c.text.strip() else ''}")
    print(f"\nbest (mean logprob {result.score:.3f}):\n{result.answer}")
    print(f"\ncost: {result.cost}")


if __name__ == "__main__":
    main()
