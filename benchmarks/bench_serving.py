"""Online serving benchmark in the style of SGLang's `bench_serving`: stream `/generate`
requests (token ids in, `ignore_eos` so every request yields exactly its output length)
at Poisson arrivals (`--request-rate`) or a fixed number in flight (`--max-concurrency`).

Datasets (token ids drawn at random from the model's vocabulary, above its special ids):
  random                   `--num-prompts` requests; input and output lengths uniform in
                           [len * range_ratio, len].
  generated-shared-prefix  G groups x P prompts; each group shares a random S-token system
                           prompt, each prompt adds a random Q-token question; O output
                           tokens each. SGLang's defaults are G=64, P=16, S=2048, Q=128,
                           O=256; here G=8, P=8, S=256, Q=32, O=32 so a run fits a shared
                           CPU and the demo model's 512 positions. The best possible prefix
                           hit rate is (P-1)*S / (P*(S+Q)) of prompt tokens (~78% here).

Printed: successful requests, duration, total input / generated tokens, request and token
throughputs, mean concurrency (sum of E2E latencies / duration), E2E latency, TTFT, TPOT
(= (E2E - TTFT) / (output tokens - 1)) and ITL (gap between streamed chunks), each mean /
median / p99, and the prefix cache hit rate (cached / prompt tokens over the responses, and
the server's cumulative `cache_hit_rate`), the client's CPU time (near 100% of one core,
the client itself limits what is measured) and the scheduler's steps (extend / decode: a
burst that arrives over time is prefilled in more, smaller steps than the engine's). `--compare-engine` then runs the same requests
through the offline `Engine` in this process, all submitted at once, and prints the
serving / engine output throughput ratio (both measured here, in the same run) and its
steps.
`--repeats N` runs the load N times (cache flushed before each) and the engine N times, and
reports the run of median duration of each: on a shared machine a single short run can
be off by 20% either way.

The server may be SGLang's Model Gateway in front of sprig workers (`--backend-url` of a
gateway, or `--dp-size N` for a local `sprig serve --dp-size N`): the server-side figures
(cache hit rate, steps) are then summed over the workers the gateway lists, and the cache
is flushed on each. `benchmarks/bench_gateway.py` compares routing policies with one
server.

    python benchmarks/bench_serving.py                               # local server, demo model
    python benchmarks/bench_serving.py --backend-url http://127.0.0.1:30000
    python benchmarks/bench_serving.py --dp-size 2 --router-policy round_robin
    python benchmarks/bench_serving.py --dataset random --num-prompts 64 --max-concurrency 64 --compare-engine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

READY = re.compile(r"ready at (http://\S+)")
LOW_ID = 8  # stay clear of small tokenizers' special ids


@dataclass
class Request:
    input_ids: list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    e2e: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


# ---- datasets ----------------------------------------------------------------------------

def random_dataset(args: argparse.Namespace, vocab: int, rng: random.Random) -> list[Request]:
    def length(n: int) -> int:
        return rng.randint(max(1, int(n * args.random_range_ratio)), n)

    return [
        Request([rng.randrange(LOW_ID, vocab) for _ in range(length(args.random_input_len))],
                length(args.random_output_len))
        for _ in range(args.num_prompts)
    ]


def shared_prefix_dataset(args: argparse.Namespace, vocab: int, rng: random.Random) -> list[Request]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(LOW_ID, vocab) for _ in range(n)]

    requests = []
    for _ in range(args.gsp_num_groups):
        system = ids(args.gsp_system_prompt_len)
        requests += [Request(system + ids(args.gsp_question_len), args.gsp_output_len)
                     for _ in range(args.gsp_prompts_per_group)]
    rng.shuffle(requests)
    return requests


DATASETS = {"random": random_dataset, "generated-shared-prefix": shared_prefix_dataset}


# ---- the load generator ------------------------------------------------------------------

async def send(client: httpx.AsyncClient, url: str, req: Request) -> Result:
    body = {"input_ids": req.input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True}}
    res, last = Result(), None
    start = prev = time.perf_counter()
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = orjson.loads(line[6:])
                if chunk["output_ids"]:
                    if last is None or not last["output_ids"]:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - prev)
                    prev = now
                last = chunk
        res.e2e = time.perf_counter() - start
    except (httpx.HTTPError, ValueError) as e:
        res.error = repr(e)
        return res
    if last is None:
        res.error = "no chunk"
        return res
    meta = last["meta_info"]
    res.prompt_tokens, res.cached_tokens = meta["prompt_tokens"], meta.get("cached_tokens", 0)
    res.output_tokens = len(last["output_ids"])
    res.ok = res.output_tokens == req.output_len
    res.error = "" if res.ok else f"{res.output_tokens} output tokens, expected {req.output_len}"
    return res


async def run_load(url: str, requests: list[Request], args: argparse.Namespace) -> tuple[list[Result], float, float]:
    """Send `requests` (Poisson arrivals or all at once, at most `--max-concurrency` in
    flight); returns the results, the wall time and the client's CPU time. Each request in
    flight has an HTTP client of its own, with one connection: one client shared by
    hundreds of streams spends most of its time in its pool's bookkeeping, which scans
    every connection per event, and would measure itself more than the server."""
    rng = random.Random(args.seed + 1)
    limit = args.max_concurrency or len(requests)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0, pool=None)
    one_connection = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    idle: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    # verify only for https: a verifying client loads its own CA bundle (128 of them: 3.3 s here)
    clients = [httpx.AsyncClient(limits=one_connection, timeout=timeout, verify=url.startswith("https"))
               for _ in range(min(limit, len(requests)))]
    for client in clients:
        idle.put_nowait(client)

    async def one(req: Request) -> Result:
        client = await idle.get()
        try:
            return await send(client, url, req)
        finally:
            idle.put_nowait(client)

    try:
        tasks = []
        cpu, start = time.process_time(), time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, time.process_time() - cpu
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


# ---- the server --------------------------------------------------------------------------

@contextmanager
def local_server(args: argparse.Namespace, flags: tuple[str, ...] = ()) -> Iterator[str]:
    """`sprig serve FLAGS` on a free port for the block; SIGTERM after it."""
    fd, log_name = tempfile.mkstemp(prefix="sprig-bench-server-", suffix=".log")
    cmd = [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(args.model), "--port", "0",
           "--dtype", args.dtype, "--max-running-requests", str(args.max_running_requests),
           *(["--cpu-threads", str(args.threads)] if args.threads else []), *flags, *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    log = Path(log_name)
    try:
        deadline = time.monotonic() + 300
        while not (match := READY.search(log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.unlink()


def worker_urls(url: str) -> list[str]:
    """The sprig servers behind `url`: a gateway's healthy workers, or `url` itself."""
    r = httpx.get(url + "/workers", timeout=10)
    if r.status_code != 200:
        return [url]
    return [w["url"] for w in r.json()["workers"] if w.get("is_healthy", True)]


def server_stats(url: str) -> dict:
    """The scheduler's stats; behind a gateway, the workers' counters summed and their cache
    hit rates weighted by the prompt tokens each saw."""
    stats = [httpx.get(u + "/get_server_info", timeout=10).json().get("stats") or {} for u in worker_urls(url)]
    if len(stats) == 1 or not all(stats):
        return stats[0] if len(stats) == 1 else {}
    total = {k: sum(s[k] for s in stats) for k, v in stats[0].items() if isinstance(v, int | float)}
    prompt = [s["prefill_tokens"] + s["cached_tokens"] for s in stats]
    total["cache_hit_rate"] = sum(s["cache_hit_rate"] * n for s, n in zip(stats, prompt, strict=True)) / max(sum(prompt), 1)
    return total


@dataclass(frozen=True)
class Steps:
    """Scheduler steps of one run: forward passes over prompt tokens, and decode steps."""

    extend: int
    decode: int


def steps_since(url: str, before: dict, generated: int, timeout: float = 5.0) -> Steps | None:
    """The server's steps since `before` (its stats then), once its stats count the
    `generated` tokens of the run (they arrive with the scheduler's periodic report);
    None for a server that does not report steps or never catches up."""
    if "decode_steps" not in before:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = server_stats(url)
        if now["decode_tokens"] - before["decode_tokens"] >= generated:
            return Steps(now["extend_steps"] - before["extend_steps"], now["decode_steps"] - before["decode_steps"])
        time.sleep(0.05)
    return None


def warm_up_server(url: str, requests: list[Request]) -> None:
    body = {"input_ids": requests[0].input_ids[:16], "sampling_params": {"max_new_tokens": 2}}
    httpx.post(url + "/generate", json=body, timeout=120).raise_for_status()


def flush_server(url: str) -> None:
    for u in worker_urls(url):
        httpx.post(u + "/flush_cache", timeout=30).raise_for_status()


def median_run(runs: list[tuple[float, Any]]) -> tuple[float, Any]:
    """The run of median duration (the lower middle one for an even count)."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


def run_engine(model: str, requests: list[Request], args: argparse.Namespace
               ) -> tuple[float, tuple[int, Steps], list[float]]:
    """The same requests through the offline Engine, all at once, `--repeats` times (cache
    flushed before each): (median seconds, (its output tokens, its scheduler steps), every
    run's seconds)."""
    from sprig.runtime import Engine

    params = [{"max_new_tokens": r.output_len, "temperature": 0, "ignore_eos": True} for r in requests]
    runs = []
    with Engine(model, dtype=args.dtype, max_running_requests=args.max_running_requests,
                cpu_threads=args.threads) as engine:
        engine.generate(input_ids=requests[0].input_ids[:16], sampling_params={"max_new_tokens": 2})
        for _ in range(args.repeats):
            engine.flush_cache()
            st = engine.scheduler.stats
            e0, d0, start = st.extend_steps, st.decode_steps, time.perf_counter()
            outs = engine.generate(input_ids=[r.input_ids for r in requests], sampling_params=params)
            seconds, tokens = time.perf_counter() - start, sum(len(o["output_ids"]) for o in outs)
            runs.append((seconds, (tokens, Steps(st.extend_steps - e0, st.decode_steps - d0))))
    seconds, result = median_run(runs)
    return seconds, result, [s for s, _ in runs]


# ---- report ------------------------------------------------------------------------------

def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    ms = np.asarray(values) * 1000
    return f"mean {ms.mean():9.2f}   median {np.median(ms):9.2f}   p99 {np.percentile(ms, 99):9.2f}  (ms)"


def report(results: list[Result], duration: float, stats: dict, client_cpu: float) -> float:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    rows = [
        ("Successful requests", f"{len(ok)} / {len(results)}"),
        ("Benchmark duration (s)", f"{duration:.2f}"),
        ("Total input tokens", inp),
        ("Total generated tokens", out),
        ("Request throughput (req/s)", f"{len(ok) / duration:.2f}"),
        ("Input token throughput (tok/s)", f"{inp / duration:.2f}"),
        ("Output token throughput (tok/s)", f"{out / duration:.2f}"),
        ("Total token throughput (tok/s)", f"{(inp + out) / duration:.2f}"),
        ("Mean concurrency", f"{sum(r.e2e for r in ok) / duration:.2f}"),
        ("E2E latency", summary([r.e2e for r in ok])),
        ("TTFT", summary([r.ttft for r in ok])),
        ("TPOT", summary([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])),
        ("ITL", summary([x for r in ok for x in r.itl])),
        ("Cache hit rate (responses)", f"{sum(r.cached_tokens for r in ok) / max(inp, 1):.2%} of prompt tokens"),
        ("Cache hit rate (server)", f"{stats['cache_hit_rate']:.2%}" if "cache_hit_rate" in stats else "n/a"),
        ("Client CPU time (s)", f"{client_cpu:.2f} ({client_cpu / duration:.0%} of one core)"),
    ]
    for name, value in rows:
        print(f"{name:<34}{value}")
    for r in results:
        if not r.ok:
            print("failed:", r.error)
            break
    return out / duration


def build_parser() -> argparse.ArgumentParser:
    from sprig.runtime.demo import DEMO_MODEL_PATH

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend-url", help="a running sprig server or gateway (default: start one with --model)")
    p.add_argument("--model", default=str(DEMO_MODEL_PATH), help="checkpoint for the local server and the engine")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-running-requests", type=int, default=64, help="local server's and engine's")
    p.add_argument("--threads", type=int, help="torch threads of the local server and the engine")
    p.add_argument("--server-arg", action="append", default=[], help="extra `sprig serve` flag (repeatable)")
    p.add_argument("--dp-size", type=int, default=1, help="local server: this many workers behind the gateway")
    p.add_argument("--router-policy", default="cache_aware", help="local server with --dp-size: the gateway's policy")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="generated-shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64, help="random dataset")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.5)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=256)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-engine", action="store_true", help="also run the offline Engine; print the ratio")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of the load (and of the engine); the median-duration run is reported")
    return p


def make_requests(url: str, args: argparse.Namespace) -> tuple[str, list[Request]]:
    """The served model's path, and the dataset's requests for its vocabulary."""
    model = httpx.get(url + "/get_model_info", timeout=10).json()["model_path"]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    requests = DATASETS[args.dataset](args, vocab, random.Random(args.seed))
    print(f"{args.dataset}: {len(requests)} requests, {sum(len(r.input_ids) for r in requests)} input tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; request rate {args.request_rate}, "
          f"max concurrency {args.max_concurrency}; server {url} ({model})")
    return model, requests


@dataclass
class Measured:
    """The median-duration run of `--repeats`, and the server's stats after the last."""

    duration: float
    results: list[Result]
    client_cpu: float
    steps: Steps | None
    stats: dict
    durations: list[float]


def measure(url: str, requests: list[Request], args: argparse.Namespace) -> Measured:
    warm_up_server(url, requests)
    runs = []
    for _ in range(args.repeats):
        flush_server(url)
        before = server_stats(url)
        results, duration, client_cpu = asyncio.run(run_load(url, requests, args))
        steps = steps_since(url, before, sum(r.output_tokens for r in results))
        runs.append((duration, (results, client_cpu, steps)))
    duration, (results, client_cpu, steps) = median_run(runs)
    return Measured(duration, results, client_cpu, steps, server_stats(url), [d for d, _ in runs])


def print_measured(m: Measured) -> float:
    """The report of `m`; returns its output throughput."""
    serving = report(m.results, m.duration, m.stats, m.client_cpu)
    if m.steps is not None:
        print(f"{'Scheduler steps (extend / decode)':<34}{m.steps.extend} / {m.steps.decode}")
    if len(m.durations) > 1:
        print(f"{'Durations of the runs (s)':<34}{', '.join(f'{d:.2f}' for d in m.durations)}")
    return serving


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    flags = ("--dp-size", str(args.dp_size), "--router-policy", args.router_policy) if args.dp_size > 1 else ()
    with local_server(args, flags) if args.backend_url is None else _given(args.backend_url) as url:
        model, requests = make_requests(url, args)
        measured = measure(url, requests, args)
    print("============ Serving Benchmark Result ============")
    serving = print_measured(measured)
    if args.compare_engine:
        seconds, (tokens, engine_steps), durations = run_engine(model, requests, args)
        engine = tokens / seconds
        print("============ Offline Engine (same requests, all at once) ============")
        print(f"{'Engine duration (s)':<34}{seconds:.2f}")
        if args.repeats > 1:
            print(f"{'Durations of the runs (s)':<34}{', '.join(f'{d:.2f}' for d in durations)}")
        print(f"{'Engine output throughput (tok/s)':<34}{engine:.2f}")
        print(f"{'Scheduler steps (extend / decode)':<34}{engine_steps.extend} / {engine_steps.decode}")
        print(f"{'Serving / engine throughput':<34}{serving / engine:.3f}")


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


if __name__ == "__main__":
    main()
