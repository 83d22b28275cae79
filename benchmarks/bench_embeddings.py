"""Embedding a retrieval corpus's queries with the offline engine, each behind the same
instruction (as Qwen3-Embedding and e5-mistral want queries written): one `encode` call
for all of them with the radix cache, the same call with the cache disabled (the shared
instruction computed for every query), and one call per query.

The embeddings must agree across the sides (checked, within float rounding). With
`--repeats N` the sides' timed runs alternate and each side's run of median time is
reported, with its prefill tokens and its time as a ratio of the first side's.

    python benchmarks/bench_embeddings.py                       # the demo model, on the CPU
    python benchmarks/bench_embeddings.py --queries 128 --repeats 5
    python benchmarks/bench_embeddings.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sprig.runtime import Engine

INSTRUCTION = ("Instruct: Given a word problem about a person's items, retrieve the worked solutions "
               "that answer it, step by step, with every equation written out\nQuery: ")
NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana"]
ITEMS = ["apples", "books", "coins", "marbles", "pens", "stamps"]


def queries(n: int) -> list[str]:
    rng = random.Random(0)
    return [f"{INSTRUCTION}{rng.choice(NAMES)} has {rng.randint(2, 90)} {rng.choice(ITEMS)} and buys "
            f"{rng.randint(2, 40)} more. How many now?" for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, interleaved")
    args = parser.parse_args()

    texts = queries(args.queries)
    common = dict(device=args.device, dtype=args.dtype)
    with Engine(args.model, **common) as cached, Engine(args.model, disable_radix_cache=True, **common) as plain:
        sides = {
            "one call, radix cache": (cached, lambda e: e.encode(texts)),
            "one call, radix cache disabled": (plain, lambda e: e.encode(texts)),
            "one call per query, radix cache": (cached, lambda e: [e.encode(t) for t in texts]),
        }
        shared = len(cached.tokenizer.encode(INSTRUCTION))
        print(f"{args.queries} queries behind a {shared}-token instruction; {args.model or 'demo model'}, "
              f"{args.dtype} on {args.device}")
        cached.encode(texts[:4])  # warm-up
        plain.encode(texts[:4])
        times: dict[str, list[float]] = {name: [] for name in sides}
        prefilled: dict[str, int] = {}
        vectors: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name, (engine, run) in sides.items():
                engine.flush_cache()
                before = engine.scheduler.stats.prefill_tokens
                start = time.perf_counter()
                outs = run(engine)
                times[name].append(time.perf_counter() - start)
                prefilled[name] = engine.scheduler.stats.prefill_tokens - before
                vectors[name] = torch.tensor([o["embedding"] for o in outs])
        cached.check_integrity()
        plain.check_integrity()
    first = next(iter(vectors.values()))
    worst = max((v - first).abs().max().item() for v in vectors.values())
    if worst > 1e-4:
        raise SystemExit(f"the sides' embeddings differ by {worst:.1e}: an embedding depends on its batch or cache")
    base = statistics.median(next(iter(times.values())))
    for name, runs in times.items():
        med = statistics.median(runs)
        print(f"  {name:34s} {med:7.3f} s  {args.queries / med:8.1f} queries/s  {prefilled[name]:6d} tokens prefilled"
              f"  {med / base:5.2f}x the first side's time")
    print(f"largest difference between the sides' embeddings: {worst:.1e}")


if __name__ == "__main__":
    main()
