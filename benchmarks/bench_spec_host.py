"""The host's share of a decode step with speculative decoding on and nothing drafted.

Where verification is dear against a decode pass (on a GPU, a graph-replayed decode pass
of a small model takes about a millisecond and an eager verification pass several), the
cost gate declines drafts, and a drafter should then cost what plain decoding costs.
This measures what it costs the host: greedy held-out demo problems at one batch size,
each side on its own engine (CPU), verification priced at a second for the gate
(`--speculative-pass-costs`, so every draft is declined whatever the timings, but the
probes `decode.PROBE_AFTER` steps apart, counted in `drafts`); the model's
forward passes are timed apart (synchronous on the CPU), and a step's host time is its
wall time less its forward pass: scheduling, asking the drafter, the gate, sampling and
emitting. Interleaved repeats, medians, and the extra host time against off.

    python benchmarks/bench_spec_host.py --threads 1
    python benchmarks/bench_spec_host.py --batch 8 --sides ngram radix draft --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from sprig.runtime import Engine
from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import take

DECLINE = "1,0,1000,0,0,0,0"  # decode 1 ms, verification 1,000 ms: the gate verifies no draft
DRAFT_MODEL_PATH = DEMO_MODEL_PATH.parent / "draft"


class StepTimer:
    """Wraps an engine's scheduler step and model forward with wall-clock sums."""

    def __init__(self, engine: Engine) -> None:
        self.step_s = self.forward_s = 0.0
        self.steps = 0
        sched = engine.scheduler
        sched.step = self._timed(sched.step, "step_s", count=True)
        sched.runner.forward = self._timed(sched.runner.forward, "forward_s")

    def _timed(self, fn: Callable[..., Any], total: str, count: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)
                self.steps += count
        return timed

    def reset(self) -> None:
        self.step_s = self.forward_s = 0.0
        self.steps = 0

    def host_ms(self) -> float:
        return (self.step_s - self.forward_s) / max(self.steps, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sides", nargs="+", default=["ngram", "radix"], choices=["ngram", "radix", "draft"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = ["off", *dict.fromkeys(args.sides)]
    engines = {
        side: Engine(dtype="float32", device="cpu", max_total_tokens=16384, max_running_requests=args.batch,
                     speculative_algorithm=None if side == "off" else side,
                     speculative_pass_costs=None if side == "off" else DECLINE,
                     speculative_draft_model_path=str(DRAFT_MODEL_PATH) if side == "draft" else None)
        for side in sides
    }
    texts = prompts(engines["off"].tokenizer, take("heldout", args.batch, seed=0))
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    timers = {}
    for side, engine in engines.items():
        engine.generate(texts[:2], {"max_new_tokens": 8, "temperature": 0})  # warm-up
        timers[side] = StepTimer(engine)
    host: dict[str, list[float]] = {side: [] for side in sides}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for side in sides[repeat % len(sides):] + sides[: repeat % len(sides)]:
            engine, timer = engines[side], timers[side]
            engine.flush_cache()
            timer.reset()
            outputs[side] = [o["output_ids"] for o in engine.generate(texts, params)]
            host[side].append(timer.host_ms())
    if any(outputs[side] != outputs["off"] for side in sides):
        raise AssertionError("speculation changed the outputs")
    print(f"demo model, float32, cpu ({torch.get_num_threads()} threads), greedy, batch {args.batch}, "
          f"every draft declined; {args.repeats} interleaved repeats, medians")
    print(f"{'side':<8}{'host ms/step':>14}{'vs off':>10}{'drafts':>8}   runs")
    base = statistics.median(host["off"])
    for side in sides:
        ms = statistics.median(host[side])
        spec = engines[side].scheduler.speculative
        drafts = spec.stats.drafted / args.repeats if spec is not None else 0
        print(f"{side:<8}{ms:>14.3f}{ms - base:>+10.3f}{drafts:>8.0f}   {', '.join(f'{x:.3f}' for x in host[side])}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
