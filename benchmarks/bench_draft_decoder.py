"""A round of the draft model's decode steps on the CPU: `DraftDecoder` against the model
runner's general path, in one run.

The demo's shipped draft (runtime/demo/draft), float32: B requests with contexts of
`--context` tokens already in the pool, each fed one token and then its own proposals for
`--steps` steps, either as one `DraftDecoder.run` or as `--steps` decode steps of
`ModelRunner.forward` (the path the draft took before, and still takes on CUDA). Runs
alternate between the two; the medians per step and their ratio are printed.

    python benchmarks/bench_draft_decoder.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.speculative.draft_decoder import DraftDecoder

DRAFT_MODEL_PATH = DEMO_MODEL_PATH.parent / "draft"


def general_round(runner: ModelRunner, slots: list[torch.Tensor], start: int, steps: int) -> None:
    fed = [7] * len(slots)
    for j in range(steps):
        ends = [start + j + 1] * len(slots)
        step = ForwardStep(ForwardMode.DECODE, fed, [1] * len(slots), ends,
                           torch.cat([s[:end] for s, end in zip(slots, ends, strict=True)]), [0] * len(slots))
        fed = runner.forward(step).argmax(dim=-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=120)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    per = args.context + args.steps
    runner = ModelRunner(RunnerConfig(model_path=str(DRAFT_MODEL_PATH), device="cpu", dtype="float32",
                                      max_total_tokens=max(args.batches) * per + 64, cpu_threads=args.threads))
    decoder = DraftDecoder(runner)
    first = runner.kv_cache.page_size
    print(f"demo draft, float32, {torch.get_num_threads()} threads, context {args.context}, "
          f"rounds of {args.steps} steps, {args.repeats} alternating repeats, medians")
    print(f"{'batch':>6}{'runner ms/step':>16}{'decoder ms/step':>17}{'ratio':>8}")
    for batch in args.batches:
        slots = [torch.arange(first + b * per, first + (b + 1) * per) for b in range(batch)]
        ids = torch.randint(3, 500, (batch * args.context,), generator=torch.Generator().manual_seed(0)).tolist()
        runner.forward(ForwardStep(ForwardMode.EXTEND, ids, [args.context] * batch, [args.context] * batch,
                                   torch.cat([s[: args.context] for s in slots]), [args.context - 1] * batch))
        start = args.context - 1
        runs = {
            "runner": lambda slots=slots, start=start: general_round(runner, slots, start, args.steps),
            "decoder": lambda slots=slots, start=start, n=batch: decoder.run(slots, [start] * n, [[7]] * n,
                                                                              [args.steps] * n),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                begun = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - begun) * 1e3 / args.steps)
        general, lean = (statistics.median(times[name]) for name in runs)
        print(f"{batch:>6}{general:>16.3f}{lean:>17.3f}{general / lean:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
