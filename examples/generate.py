"""Generate with the offline engine: solve held-out word problems with sprig's embedded
demo model, greedy and by self-consistency voting, and watch the radix cache at work.

    python examples/generate.py [--problems 16] [-n 8] [--seed 0] [--model PATH]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from sprig.runtime import Engine
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import extract_answer, take


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--problems", type=int, default=16, help="held-out problems to solve")
    parser.add_argument("-n", type=int, default=8, help="samples per problem for voting")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (sample i of a problem uses seed + i)")
    args = parser.parse_args()

    problems = take("heldout", args.problems, seed=0)
    with Engine(args.model) as engine:
        texts = prompts(engine.tokenizer, problems)
        start = time.perf_counter()
        greedy = engine.generate(texts, {"max_new_tokens": 128, "temperature": 0})
        greedy_s = time.perf_counter() - start
        print(f"Q: {problems[0].question}\nA: {greedy[0]['text']}\n(right answer: {problems[0].answer})\n")
        start = time.perf_counter()
        sampled = engine.generate(texts, {"max_new_tokens": 128, "temperature": 0.6, "top_p": 0.9, "n": args.n, "seed": args.seed})
        vote_s = time.perf_counter() - start

        greedy_ok = sum(extract_answer(o["text"]) == p.answer for o, p in zip(greedy, problems, strict=True))
        vote_ok = 0
        for i, p in enumerate(problems):
            answers = [extract_answer(o["text"]) for o in sampled[i * args.n : (i + 1) * args.n]]
            votes = Counter(a for a in answers if a is not None)
            vote_ok += bool(votes) and votes.most_common(1)[0][0] == p.answer
        prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in sampled)
        cached = sum(o["meta_info"]["cached_tokens"] for o in sampled)
        print(f"greedy:                   {greedy_ok}/{len(problems)} correct in {greedy_s:.1f} s")
        print(f"self-consistency (n={args.n}): {vote_ok}/{len(problems)} correct in {vote_s:.1f} s")
        print(f"the {args.n} samples of each problem reused its prompt: {cached} of {prompt_tokens} "
              f"prompt tokens came from the radix cache")
        engine.check_integrity()


if __name__ == "__main__":
    main()
