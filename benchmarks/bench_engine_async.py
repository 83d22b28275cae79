"""Concurrent callers of one offline engine: `async_generate` from C coroutines at once vs
the same calls made one after another with `generate`, and vs one batched `generate` of
every prompt (the most batching can give).

Each of the C callers makes K calls in turn (a short agent loop: a call's prompt is the
previous call's prompt and answer, plus a new question), greedy, O tokens each; the
calls are the same on every side, so their outputs must be too (checked). With
`--repeats N` the sides' timed runs alternate and each side's run of median time is
reported, with the ratios of the sequential and batched sides' times to the async side's.

    python benchmarks/bench_engine_async.py                   # the demo model, on the CPU
    python benchmarks/bench_engine_async.py --callers 32 --repeats 5
    python benchmarks/bench_engine_async.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from sprig.runtime import Engine

QUESTIONS = ["What is 12 + 7?", "And times 3?", "Minus 5?", "Half of that?", "Plus 100?", "Squared?"]


def first_prompts(callers: int) -> list[str]:
    return [f"Tom has {3 + i} apples and buys {2 + i % 5} more. " for i in range(callers)]


async def async_side(engine: Engine, prompts: list[str], calls: int, params: dict) -> list[str]:
    async def caller(prompt: str) -> str:
        for k in range(calls):
            prompt += QUESTIONS[k % len(QUESTIONS)]
            prompt += (await engine.async_generate(prompt, params))["text"]
        return prompt

    return list(await asyncio.gather(*(caller(p) for p in prompts)))


def sequential_side(engine: Engine, prompts: list[str], calls: int, params: dict) -> list[str]:
    out = []
    for prompt in prompts:
        for k in range(calls):
            prompt += QUESTIONS[k % len(QUESTIONS)]
            prompt += engine.generate(prompt, params)["text"]
        out.append(prompt)
    return out


def batched_side(engine: Engine, prompts: list[str], calls: int, params: dict) -> list[str]:
    for k in range(calls):
        prompts = [p + QUESTIONS[k % len(QUESTIONS)] for p in prompts]
        prompts = [p + o["text"] for p, o in zip(prompts, engine.generate(prompts, params), strict=True)]
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--callers", type=int, default=16, help="concurrent coroutines (C)")
    parser.add_argument("--calls", type=int, default=2, help="calls each caller makes in turn (K)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per call (O)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, interleaved")
    args = parser.parse_args()

    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    prompts = first_prompts(args.callers)
    sides = {
        "async_generate, C callers at once": lambda e: asyncio.run(async_side(e, prompts, args.calls, params)),
        "generate, one call after another": lambda e: sequential_side(e, prompts, args.calls, params),
        "generate, every caller's k-th call in one batch": lambda e: batched_side(e, prompts, args.calls, params),
    }
    with Engine(args.model, device=args.device, dtype=args.dtype) as engine:
        print(f"{args.callers} callers x {args.calls} calls x {args.output_len} tokens, greedy; "
              f"{args.model or 'demo model'}, {args.dtype} on {args.device}")
        sides["generate, one call after another"](engine)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        texts: dict[str, list[str]] = {}
        for _ in range(args.repeats):
            for name, run in sides.items():
                engine.flush_cache()
                start = time.perf_counter()
                texts[name] = run(engine)
                times[name].append(time.perf_counter() - start)
        engine.check_integrity()
    if len({tuple(t) for t in texts.values()}) != 1:
        raise SystemExit("the sides' outputs differ: a request's output depends on its batch")
    tokens = args.callers * args.calls * args.output_len
    base = statistics.median(times["async_generate, C callers at once"])
    for name, runs in times.items():
        med = statistics.median(runs)
        print(f"  {name:50s} {med:7.2f} s  {tokens / med:8.1f} tok/s  {med / base:5.2f}x the async side's time")


if __name__ == "__main__":
    main()
