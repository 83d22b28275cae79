"""Held-out evaluation of the demo model, per task, on sprig's offline engine; prints a
table of accuracies beside the targets the model is held to.

    python scripts/eval_demo_model.py [--model PATH] [--dialogues N] [--problems 200]

Tasks (`sprig.runtime.demo.mixture`): tool calls (each turn given the dialogue's own
history, and whole runs that execute the model's calls), JSON extraction (written
freely and constrained to the schema), few-shot answers over facts in the prompt,
multi-turn chat (after the model's own earlier replies), and the arithmetic word
problems (greedy, and `--samples` seeded samples: one alone, their majority, any).
Each task scores 200 held-out dialogues, few-shot 1,000 (`DIALOGUES`); each accuracy comes
with its 95% interval.
"""

from __future__ import annotations

import argparse
import time

from sprig.runtime import Engine
from sprig.runtime.demo import mixture, tasks
from sprig.runtime.demo.scoring import SCORERS, Measure, score_arithmetic

# Held-out dialogues per task. Few-shot's accuracy lies within a few points of its target,
# and on 200 dialogues its 95% interval is about +-5.5 points at 80%; on 1,000, +-2.5.
DIALOGUES = {name: 1000 if name == "few-shot" else 200 for name in SCORERS}


def table(measures: list[Measure]) -> str:
    lines = ["| task | measure | right | held-out | accuracy | 95% interval | target |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for m in measures:
        low, high = m.interval()
        lines.append(f"| {m.task} | {m.what} | {m.right} | {m.total} | {m.rate:.1%} | {low:.1%}-{high:.1%} "
                     f"| {m.target} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the shipped demo model)")
    parser.add_argument("--dialogues", type=int, help="held-out dialogues of every task (default: 200, few-shot "
                        "1,000)")
    parser.add_argument("--problems", type=int, default=200, help="held-out arithmetic problems")
    parser.add_argument("--samples", type=int, default=16, help="samples per arithmetic problem")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="problem draw and sampling seed")
    parser.add_argument("--tasks", nargs="*", choices=[*SCORERS, "arithmetic"], default=[*SCORERS, "arithmetic"])
    args = parser.parse_args()

    start = time.monotonic()
    measures: list[Measure] = []
    with Engine(args.model) as engine:
        tok = engine.tokenizer
        for name in args.tasks:
            if name == "arithmetic":
                problems = tasks.take("heldout", args.problems, seed=args.seed)
                measures += score_arithmetic(engine, tok, problems, args.samples, args.seed, args.temperature,
                                             args.top_p)
            else:
                n = DIALOGUES[name] if args.dialogues is None else args.dialogues
                measures += SCORERS[name](engine, tok, mixture.take_task(name, "heldout", n, args.seed))
            print(f"{name} scored ({time.monotonic() - start:.0f} s)", flush=True)
    print(table(measures))
    print(f"\narithmetic sampling: T={args.temperature}, top_p {args.top_p}, seed {args.seed}; "
          f"{time.monotonic() - start:.0f} s in all")


if __name__ == "__main__":
    main()
