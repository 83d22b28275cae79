"""Measure the demo model with transformers: greedy accuracy and majority-vote accuracy.

python scripts/eval_demo_model.py --greedy 200 --vote 200 --samples 16 --temperature 0.6 --top-p 0.9
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime.demo import ensure_demo_model, tasks
from sprig.runtime.demo.evaluate import accuracy, generate


def main() -> None:
    """Print greedy accuracy on held-out problems, then single-sample vs majority-of-N."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint directory (default: the shipped demo model)")
    parser.add_argument("--greedy", type=int, default=200, help="held-out problems for greedy")
    parser.add_argument("--vote", type=int, default=200, help="held-out problems for voting")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    path = args.model or ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    problems = tasks.take("heldout", max(args.greedy, args.vote), seed=args.seed)

    start = time.monotonic()
    greedy = problems[: args.greedy]
    greedy_acc = accuracy(greedy, generate(model, tok, greedy))
    print(f"greedy accuracy: {greedy_acc:.1%} on {len(greedy)} held-out problems")
    voted = problems[: args.vote]
    if not voted:
        return
    samples = generate(
        model, tok, voted, num_samples=args.samples, temperature=args.temperature, top_p=args.top_p
    )
    single, vote = accuracy(voted, samples), accuracy(voted, samples, vote=True)
    answers = [{tasks.extract_answer(s) for s in row} for row in samples]
    oracle = sum(p.answer in seen for p, seen in zip(voted, answers, strict=True)) / len(voted)
    distinct = sum(map(len, answers)) / len(answers)
    print(
        f"T={args.temperature}, top_p {args.top_p} on {len(voted)} problems: one sample {single:.1%}, "
        f"majority of {args.samples} {vote:.1%} ({vote / max(single, 1e-9):.2f}x); "
        f"any of {args.samples} right {oracle:.1%}; "
        f"{distinct:.1f} distinct answers per problem; {time.monotonic() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
