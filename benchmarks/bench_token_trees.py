"""Token trees on sibling samples: the radix drafter with and without alternative paths.

One held-out demo problem, N seeded samples at temperature T run one after another (at
most one request in flight), so each sample's drafts come from the samples before it.
Each side runs on its own engine: `radix` (up to 3 alternative paths a step) and
`radix-path` (`speculative_alternatives=0`), in interleaved repeats, the radix cache
flushed before each; medians of target passes and wall time, the alternative paths
verified and followed, and the ratios against radix-path. Outputs are checked equal.
`--free` sets the verification pass's costs to zero for the gate
(`--speculative-pass-costs`), so every path the drafter proposes is verified: what token
trees can find on the workload, whatever they cost.

    python benchmarks/bench_token_trees.py --threads 1
    python benchmarks/bench_token_trees.py --samples 32 --temperature 0.8 --free --threads 1
    python benchmarks/bench_token_trees.py --samples 32 --temperature 0.8 --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sprig.runtime import Engine
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import take

FREE_COSTS = "4.88,0.9478,6.144,0,0,0,0"  # decode as measured on the 2-core VM, verification free


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--free", action="store_true", help="verification passes cost nothing to the gate")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="the model's weights and KV")
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="each engine's KV pool (two share a GPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = {"radix": 3, "radix-path": 0}
    engines = {side: Engine(dtype=args.dtype, device=args.device, max_total_tokens=args.max_total_tokens,
                            speculative_algorithm="radix", speculative_alternatives=width, max_running_requests=1,
                            speculative_pass_costs=FREE_COSTS if args.free else None)
               for side, width in sides.items()}
    text = prompts(engines["radix"].tokenizer, take("heldout", 1, seed=0))
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": 0.9,
              "n": args.samples, "sampling_seed": 1}
    runs: dict[str, list[tuple[float, int, int, int, list]]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        for side in list(sides)[repeat % 2:] + list(sides)[: repeat % 2]:
            engine = engines[side]
            engine.flush_cache()
            stats, sched = engine.scheduler.speculative.stats, engine.scheduler.stats
            before = (stats.alternatives, stats.alternatives_kept, sched.extend_steps + sched.decode_steps)
            start = time.perf_counter()
            outputs = [o["output_ids"] for o in engine.generate(text, params)]
            seconds = time.perf_counter() - start
            runs[side].append((seconds, sched.extend_steps + sched.decode_steps - before[2],
                               stats.alternatives - before[0], stats.alternatives_kept - before[1], outputs))
    if any(r[4] != runs["radix-path"][0][4] for rs in runs.values() for r in rs):
        raise AssertionError("token trees changed the outputs")
    base_s = statistics.median(r[0] for r in runs["radix-path"])
    base_p = statistics.median(r[1] for r in runs["radix-path"])
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"demo model, {args.dtype}, {args.device} ({where}), {args.samples} samples at T = {args.temperature}, "
          f"one at a time; {'verification free to the gate' if args.free else 'measured pass costs'}; "
          f"{args.repeats} interleaved repeats, medians")
    print(f"{'side':<12}{'wall s':>8}{'passes':>8}{'paths':>7}{'followed':>10}{'passes x':>10}{'wall x':>8}")
    for side in sides:
        s = statistics.median(r[0] for r in runs[side])
        p = statistics.median(r[1] for r in runs[side])
        alt = statistics.median(r[2] for r in runs[side])
        kept = statistics.median(r[3] for r in runs[side])
        print(f"{side:<12}{s:>8.2f}{p:>8.0f}{alt:>7.0f}{kept:>10.0f}{base_p / p:>10.2f}{base_s / s:>8.2f}")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
