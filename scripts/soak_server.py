"""Soak a local `sprig serve`: many mixed requests, some abandoned, some hostile, bounded in
time; then check that nothing failed on the server's side and nothing was left behind.

    python scripts/soak_server.py [--requests 20000] [--concurrency 32] [--max-seconds 1800]
    python scripts/soak_server.py --url http://127.0.0.1:30000   # a server already running

The mix: /generate (plain, batched, streamed), /v1/completions and /v1/chat/completions
(streamed or not), short prompts and outputs, /v1/score and /v1/embeddings; `--abort-share` of the
requests are abandoned mid-stream by their client or aborted with /abort_request;
`--hostile-share` are hostile (nesting past the bound, a prompt past the context, wrong
types, a template in chat_template_kwargs, a batch past the in-flight bound, scoring that
would tokenize a long query for every item, an unparseable body, a weight update from a
path that holds no checkpoint); every `--update-every`-th request reloads the served
checkpoint's weights (/update_weights_from_disk, with a new weight_version) while the
others run. It passes when no answer is a 5xx, every weight update succeeded, every hostile
request got a 4xx, the KV integrity check
is ok, and after /flush_cache and a few idle seconds the resident memory of every server
process is within `--rss-slack` of what it was, measured the same way, after the warm-up
(the first `--warmup` requests). Exits 1
otherwise, printing why.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

import sprig

SETTLE_S = 4.0  # an idle scheduler hands its free heap back within about 2.5 s (`SchedulerLoop.idle_maintenance`)
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "red", "blue", "quick", "fox", "what", "how", "one", "two", "three"]
MESSAGES = [{"role": "user", "content": "Ava has 3 apples. How many?"}]


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))


def nested(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def hostile(rng: random.Random) -> tuple[str, dict[str, Any] | bytes]:
    kind = rng.randrange(9)
    if kind == 0:
        return "/generate", {"text": "a", "sampling_params": {"json_schema": nested(200)}}
    if kind == 1:
        return "/generate", {"text": "the cat " * 200_000}
    if kind == 2:
        return "/generate", {"text": 5, "sampling_params": "hot"}
    if kind == 3:
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                        "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}
    if kind == 4:
        return "/generate", {"text": ["a"] * 40, "sampling_params": {"n": 128, "max_new_tokens": 1}}
    if kind == 5:
        return "/v1/completions", {"prompt": "a", "max_tokens": -5, "logit_bias": {"x": "y"}}
    if kind == 6:
        return "/v1/score", {"query": "x" * 40_000, "items": ["a"] * 1000, "label_token_ids": [0]}
    if kind == 7:
        return "/update_weights_from_disk", {"model_path": "/nonexistent/checkpoint", "weight_version": "never"}
    return "/generate", b'{"text": "unterminated'


def ordinary(rng: random.Random) -> tuple[str, dict[str, Any], bool]:
    """(path, body, streamed)."""
    kind = rng.randrange(7)
    stream = rng.random() < 0.4
    max_new = rng.randint(1, 16)
    if kind == 0:
        return "/generate", {"text": text(rng), "stream": stream,
                             "sampling_params": {"max_new_tokens": max_new, "temperature": rng.choice([0, 0.8])}}, stream
    if kind == 1:
        return "/generate", {"text": [text(rng) for _ in range(rng.randint(2, 6))],
                             "sampling_params": {"max_new_tokens": max_new, "n": rng.choice([1, 2])}}, False
    if kind == 2:
        return "/v1/completions", {"prompt": text(rng), "max_tokens": max_new, "stream": stream}, stream
    if kind == 3:
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": max_new, "stream": stream}, stream
    if kind == 5:
        return "/v1/embeddings", {"input": [text(rng) for _ in range(rng.randint(1, 4))],
                                  "encoding_format": rng.choice(["float", "base64"])}, False
    if kind == 4:
        return "/v1/score", {"query": text(rng), "items": [text(rng) for _ in range(rng.randint(1, 6))],
                             "label_token_ids": rng.sample(range(64), rng.randint(1, 4)),
                             "apply_softmax": rng.random() < 0.5}, False
    return "/generate", {"text": text(rng), "sampling_params": {"max_new_tokens": max_new, "regex": "(yes|no|maybe)"}}, False


class Soak:
    def __init__(self, url: str, headers: dict[str, str], args: argparse.Namespace) -> None:
        self.url, self.headers, self.args = url, headers, args
        self.statuses: Counter[str] = Counter()
        self.failures: list[str] = []
        self.model_path = httpx.get(url + "/get_model_info", headers=headers, timeout=30).json()["model_path"]
        self.lock = threading.Lock()
        self.local = threading.local()

    def client(self) -> httpx.Client:
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=120.0)
        return self.local.client

    def record(self, kind: str, status: int, note: str = "") -> None:
        with self.lock:
            self.statuses[f"{kind} {status}"] += 1
            if (status >= 500 or (kind == "hostile" and not 400 <= status < 500)
                    or (kind == "update" and status != 200)):
                self.failures.append(f"{kind} answered {status} {note[:200]}")

    def one(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        client = self.client()
        if self.args.update_every and i and i % self.args.update_every == 0:
            r = client.post("/update_weights_from_disk", json={"model_path": self.model_path,
                                                               "weight_version": f"soak-{i}"})
            self.record("update", r.status_code, r.text)
            return
        roll = rng.random()
        if roll < self.args.hostile_share:
            path, body = hostile(rng)
            r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
            self.record("hostile", r.status_code, r.text)
            return
        path, body, stream = ordinary(rng)
        abandon = roll < self.args.hostile_share + self.args.abort_share
        if abandon and stream:
            with client.stream("POST", path, json=body) as r:
                self.record("abandoned", r.status_code)
                for line in r.iter_lines():
                    if line:
                        break  # hang up after the first event
            return
        if abandon:  # abort by id while it runs
            rid = f"soak-{self.args.seed}-{i}"
            body = {"text": text(rng), "rid": rid, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
            threading.Timer(0.05, lambda: client_abort(self.url, self.headers, rid)).start()
            r = client.post("/generate", json=body)
            self.record("aborted", r.status_code, r.text)
            return
        if stream:
            with client.stream("POST", path, json=body) as r:
                for _ in r.iter_lines():
                    pass
                self.record("ordinary", r.status_code)
            return
        r = client.post(path, json=body)
        self.record("ordinary", r.status_code, r.text)


def client_abort(url: str, headers: dict[str, str], rid: str) -> None:
    httpx.post(url + "/abort_request", json={"rid": rid}, headers=headers, timeout=30.0)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(soak: Soak, first: int, count: int, deadline: float, desc: str) -> int:
    """Requests `first .. first+count-1`; returns how many were sent before the deadline."""
    sent = 0
    with ThreadPoolExecutor(soak.args.concurrency) as pool, tqdm(total=count, desc=desc, unit="req") as bar:
        futures = []
        for i in range(first, first + count):
            if time.monotonic() > deadline:
                break
            futures.append(pool.submit(soak.one, i))
            sent += 1
            while len([f for f in futures if not f.done()]) >= 4 * soak.args.concurrency:
                time.sleep(0.01)
            done = [f for f in futures if f.done()]
            for f in done:
                if f.exception() is not None:
                    soak.failures.append(f"client error: {f.exception()!r}")
                bar.update()
            futures = [f for f in futures if not f.done()]
        for f in futures:
            if f.exception() is not None:
                soak.failures.append(f"client error: {f.exception()!r}")
            bar.update()
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on the demo model)")
    parser.add_argument("--model", help="checkpoint for the local server (default: the demo model)")
    parser.add_argument("--api-key")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=1000, help="requests before the memory baseline")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--abort-share", type=float, default=0.10)
    parser.add_argument("--hostile-share", type=float, default=0.02)
    parser.add_argument("--update-every", type=int, default=1000,
                        help="every N-th request is a weight update (0: none)")
    parser.add_argument("--rss-slack", type=float, default=0.10)
    parser.add_argument("--max-seconds", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with ExitStack() as stack:
        url = args.url or stack.enter_context(sprig.Runtime(args.model, log_level="warning")).url
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        soak = Soak(url, headers, args)
        start = time.monotonic()
        deadline = start + args.max_seconds
        pids = httpx.get(url + "/get_server_info", headers=headers, timeout=30).json()["pids"]
        warm = run(soak, 0, args.warmup, deadline, "warm-up")
        wait_idle(url, headers)
        httpx.post(url + "/flush_cache", headers=headers, timeout=60)
        time.sleep(SETTLE_S)
        baseline = {name: rss_mb(pid) for name, pid in pids.items()}
        sent = warm + run(soak, args.warmup, args.requests - args.warmup, deadline, "soak")
        elapsed = time.monotonic() - start
        idle = wait_idle(url, headers)
        flushed = httpx.post(url + "/flush_cache", headers=headers, timeout=60).status_code
        time.sleep(SETTLE_S)
        after = {name: rss_mb(pid) for name, pid in pids.items()}

    print(f"\n{sent} requests in {elapsed:.0f} s ({sent / elapsed:.1f}/s), concurrency {args.concurrency}")
    for key, n in sorted(soak.statuses.items()):
        print(f"  {key}: {n}")
    print(f"integrity after: {idle}")
    print(f"flush_cache: {flushed}")
    ok = not soak.failures and idle.get("ok") and flushed == 200
    for name in baseline:
        change = after[name] / baseline[name] - 1 if baseline[name] else 0.0
        within = abs(change) <= args.rss_slack
        ok = ok and within
        print(f"  RSS {name}: {baseline[name]:.0f} MB after warm-up -> {after[name]:.0f} MB ({change:+.1%})"
              f"{'' if within else '  OVER'}")
    for failure in soak.failures[:20]:
        print("FAIL", failure)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def wait_idle(url: str, headers: dict[str, str], timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/debug/check_integrity", headers=headers, timeout=30).json()
        if state["running"] == state["waiting"] == state["live"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
