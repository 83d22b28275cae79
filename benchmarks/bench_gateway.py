"""Data parallelism behind SGLang's Model Gateway against one server, on the same requests
(bench_serving's datasets, load generator and report; every bench_serving flag applies).

Setups: one `sprig serve` with N x `--max-total-tokens` KV slots, and for each of
`--router-policies` a `sprig serve --dp-size N --router-policy P` whose N workers have
`--max-total-tokens` each (the same KV memory in every setup, split in N). All are
started first; then each round runs the requests once through every setup in turn (the
cache flushed before each run), so a change in the machine's load hits all setups alike;
`--repeats` rounds, and each setup's run of median duration is reported. Printed: each
setup's bench_serving report, then a table of the prefix hit rate (cached / prompt tokens
over the responses) and output throughput, against the one server. The hit rate is the
point: with a working set larger than one worker's cache, `cache_aware` sends each shared
prefix to one worker and keeps the one server's hit rate, where `round_robin` makes every
worker hold every prefix. On one machine's CPU the workers share its cores, so the
throughput ratio is no speedup figure there.

    python benchmarks/bench_gateway.py --max-total-tokens 2048 --gsp-prompts-per-group 16 --gsp-output-len 4 \
        --max-concurrency 4 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from contextlib import ExitStack

import bench_serving as bs


def main() -> None:
    p = bs.build_parser()
    p.description, p.epilog = __doc__, None
    p.set_defaults(dp_size=2)
    p.add_argument("--router-policies", nargs="+", default=["cache_aware", "round_robin"],
                   help="the gateway's policies to compare")
    p.add_argument("--max-total-tokens", type=int,
                   help="KV slots of each worker (the one server gets --dp-size times as many)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers (the `with` below) on SIGTERM too
    if args.backend_url or args.compare_engine or args.dp_size < 2:
        p.error("bench_gateway starts its own servers: no --backend-url or --compare-engine; --dp-size >= 2")
    n, pool = args.dp_size, args.max_total_tokens
    setups = [("one server", n * pool if pool else None, ())]
    setups += [(f"{n} workers, {policy}", pool, ("--dp-size", str(n), "--router-policy", policy))
               for policy in args.router_policies]
    titles = [f"{name}, {slots} KV slots{' each' if flags else ''}" if slots else name for name, slots, flags in setups]
    runs: list[list[bs.Measured]] = [[] for _ in setups]
    with ExitStack() as servers:
        urls = [servers.enter_context(bs.local_server(args, (*flags, *(("--max-total-tokens", str(slots)) if slots else ()))))
                for _, slots, flags in setups]
        _, requests = bs.make_requests(urls[0], args)
        for _ in range(args.repeats):
            for url, measured in zip(urls, runs, strict=True):
                measured.append(bs.measure(url, requests, argparse.Namespace(**{**vars(args), "repeats": 1})))
    rows = []
    for title, measured in zip(titles, runs, strict=True):
        median = bs.median_run([(m.duration, m) for m in measured])[1]
        print(f"============ {title} ============")
        throughput = bs.print_measured(dataclasses.replace(median, durations=[m.duration for m in measured]))
        ok = [r for r in median.results if r.ok]
        hit = sum(r.cached_tokens for r in ok) / max(sum(r.prompt_tokens for r in ok), 1)
        rows.append((title, hit, throughput, f"{len(ok)} / {len(median.results)}"))
    print(f"============ {n} workers behind the gateway vs one server ============")
    print(f"{'setup':<46}{'ok':>10}{'prefix hit rate':>17}{'output tok/s':>14}{'vs one server':>15}")
    for title, hit, throughput, ok in rows:
        print(f"{title:<46}{ok:>10}{hit:>17.1%}{throughput:>14.2f}{throughput / rows[0][2]:>15.3f}")


if __name__ == "__main__":
    main()
