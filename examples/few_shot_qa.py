"""Few-shot question answering: worked examples form a shared prefix that the radix cache
computes once and every question reuses.

    python examples/few_shot_qa.py [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig

SHOTS = [
    ("Ava has 3 apples. Then Ava buys 4 more. How many apples does Ava have now?", "3 + 4 = 7\nAnswer: 7"),
    ("Ben has 10 coins. Then Ben gives away 6. How many coins does Ben have now?", "10 - 6 = 4\nAnswer: 4"),
]
QUESTIONS = [
    "Cara has 5 pens. Then Cara buys 2 more. How many pens does Cara have now?",
    "Dan has 9 books. Then Dan gives away 3. How many books does Dan have now?",
    "Eli has 4 shells. Then Eli doubles them. How many shells does Eli have now?",
]


@sprig.function
def few_shot(s, question: str):
    for q, a in SHOTS:
        s += sprig.user(q)
        s += sprig.assistant(a)
    s += sprig.user(question)
    s += sprig.assistant(sprig.gen("answer", max_tokens=64, temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        few_shot.run(question=QUESTIONS[0])  # the shared prefix is cached from here on
        states = few_shot.run_batch([{"question": q} for q in QUESTIONS], progress_bar=False)
    for q, s in zip(QUESTIONS, states, strict=True):
        meta = s.get_meta_info("answer")
        print(f"{q}\n  {s['answer'].strip()}".replace("\n", "\n  "))
        print(f"  ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens came from the cache)")


if __name__ == "__main__":
    main()
