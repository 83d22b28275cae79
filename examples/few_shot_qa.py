"""Few-shot question answering over facts given in the prompt: the facts and two
answered questions (which show the style of answer) form a shared prefix that the radix
cache computes once and every question reuses.

    python examples/few_shot_qa.py [--url URL | --model PATH]
"""

from __future__ import annotations

from _backend import backend, parser

import sprig

FACTS = """Answer questions using these facts.
Mia lives in Oslo.
Ben is 34 years old.
Mia works as a nurse.
Ben has a dog named Rex.
Ben lives in Lima.
Mia's favorite color is green."""
SHOTS = [("What is Mia's job?", "Mia works as a nurse."), ("What is the name of Ben's dog?", "Ben's dog is named Rex.")]
QUESTIONS = ["How old is Ben?", "What is Mia's favorite color?", "Where does Mia live?"]


@sprig.function
def few_shot(s, question: str):
    s += sprig.system(FACTS)
    for q, a in SHOTS:
        s += sprig.user(q)
        s += sprig.assistant(a)
    s += sprig.user(question)
    s += sprig.assistant(sprig.gen("answer", max_tokens=32, temperature=0))


def main() -> None:
    args = parser(__doc__).parse_args()
    with backend(args):
        few_shot.run(question=QUESTIONS[0])  # the shared prefix is cached from here on
        states = few_shot.run_batch([{"question": q} for q in QUESTIONS], progress_bar=False)
    print(FACTS, end="\n\n")
    for q, s in zip(QUESTIONS, states, strict=True):
        meta = s.get_meta_info("answer")
        print(f"{q} -> {s['answer'].strip()}")
        print(f"  ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens came from the cache)")


if __name__ == "__main__":
    main()
