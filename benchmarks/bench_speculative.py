"""Speculative decoding on the demo task: each drafter vs plain decoding, in one run.

Workloads (held-out demo problems, chat-formatted): greedy, and self-consistency (n = 8
seeded samples per problem at T = 0.6, top_p 0.9), each at batch 1, 8 and 64: at most
that many sequences in flight (`max_running_requests`); greedy runs `batch` problems,
self-consistency batch / 8 problems of 8 samples (one problem at batch 1, whose samples
then run one after another). Every side runs on its own engine per batch size, warmed up
first; timed runs alternate sides
(off, ngram, radix, draft, off, ...) with the radix cache flushed before each, and each side's
median run is reported: wall time, target forward passes (extend + verification/decode
steps), mean tokens per request per pass, and the ratios against off. Outputs are
checked equal to off's (greedy and seeded sampling are exact under speculation). The
draft side's draft model is the one shipped for the demo model (runtime/demo/draft,
`scripts/train_draft_model.py`).

    python benchmarks/bench_speculative.py                 # the embedded demo model
    python benchmarks/bench_speculative.py --repeats 5 --batches 1 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from sprig.runtime import Engine
from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import take

SIDES = (None, "ngram", "radix", "draft")
DRAFT_MODEL_PATH = DEMO_MODEL_PATH.parent / "draft"


@dataclass
class Run:
    seconds: float
    passes: int
    accept_length: float
    outputs: list[list[int]]


def workload(task: str, batch: int, problems: list[str], max_new: int) -> tuple[list[str], dict]:
    if task == "greedy":
        return problems[:batch], {"max_new_tokens": max_new, "temperature": 0}
    count = max(1, batch // 8)
    return problems[:count], {"max_new_tokens": max_new, "temperature": 0.6, "top_p": 0.9, "n": 8, "sampling_seed": 1}


def timed(engine: Engine, texts: list[str], params: dict) -> Run:
    engine.flush_cache()
    sched = engine.scheduler
    passes0 = sched.stats.extend_steps + sched.stats.decode_steps
    spec = sched.speculative.stats if sched.speculative else None
    emitted0, steps0 = (spec.emitted, spec.request_steps) if spec else (0, 0)
    start = time.perf_counter()
    outs = engine.generate(texts, params)
    seconds = time.perf_counter() - start
    passes = sched.stats.extend_steps + sched.stats.decode_steps - passes0
    accept = (spec.emitted - emitted0) / max(1, spec.request_steps - steps0) if spec else 1.0
    return Run(seconds, passes, accept, [o["output_ids"] for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--sides", nargs="+", default=["off", *SIDES[1:]], choices=["off", *SIDES[1:]])
    args = ap.parse_args()
    sides = tuple(None if s == "off" else s for s in dict.fromkeys(["off", *args.sides]))
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {
        (side, batch): Engine(dtype="float32", speculative_algorithm=side, max_running_requests=batch,
                              speculative_num_draft_tokens=args.num_draft_tokens,
                              speculative_draft_model_path=str(DRAFT_MODEL_PATH) if side == "draft" else None)
        for side in sides for batch in args.batches
    }
    tokenizer = engines[None, args.batches[0]].tokenizer
    problems = prompts(tokenizer, take("heldout", max(args.batches), seed=0))
    for engine in engines.values():  # warm-up
        engine.generate(problems[:2], {"max_new_tokens": 8, "temperature": 0})
    print(f"demo model, float32, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats, medians; "
          f"--num-draft-tokens {args.num_draft_tokens}")
    print(f"{'task':<18}{'batch':>6} {'side':<7}{'wall s':>9}{'passes':>8}{'tok/pass':>9}{'passes x':>9}{'wall x':>8}")
    for task in ("greedy", "self-consistency"):
        for batch in args.batches:
            texts, params = workload(task, batch, problems, args.max_new_tokens)
            runs: dict[str | None, list[Run]] = {side: [] for side in sides}
            for _ in range(args.repeats):
                for side in sides:
                    runs[side].append(timed(engines[side, batch], texts, params))
            base = runs[None][0].outputs
            for side in sides:
                if any(r.outputs != base for r in runs[side]):
                    raise AssertionError(f"{task} batch {batch}: {side} changed the outputs")
            off_s = statistics.median(r.seconds for r in runs[None])
            off_p = statistics.median(r.passes for r in runs[None])
            for side in sides:
                s = statistics.median(r.seconds for r in runs[side])
                p = statistics.median(r.passes for r in runs[side])
                a = statistics.median(r.accept_length for r in runs[side])
                print(f"{task:<18}{batch:>6} {side or 'off':<7}{s:>9.2f}{p:>8.0f}{a:>9.2f}{off_p / p:>9.2f}{off_s / s:>8.2f}",
                      flush=True)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
