"""Data parallelism behind SGLang's Model Gateway (`smg`, the `gateway` extra): real sprig
workers, the real gateway, real requests.

The shared-prefix workload is SGLang's generated-shared-prefix shape at a size a shared
CPU runs in seconds: 32 groups x 4 prompts, each prompt a group's 96-token system prompt
plus an 8-token question, 2 output tokens, in shuffled order. Each worker's KV pool holds
every group's prompts, because the gateway places a prefix it has not seen by load, not
by room: on a busy machine one worker has got 25 of the 32 groups, and with room for only
a share of them that worker's evictions, not the routing, would decide the hit rate. So
what is measured is where each prefix is computed: once in the fleet, as by one server,
when requests follow their prefix (cache_aware), and on both workers for most groups when
they alternate (round robin). Hit rate: cached / prompt tokens over the responses.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import TIMEOUT, Server, cmdline, descendants, pid_alive
from transformers import AutoModelForCausalLM
from weight_checkpoints import perturbed_copy

from sprig.runtime.cli import build_parser, configs_from_args
from sprig.runtime.server.dp import config_flags, worker_command
from sprig.runtime.server.dp_config import GatewayConfig
from sprig.runtime.server.gateway import gateway_installed

needs_gateway = pytest.mark.skipif(
    not gateway_installed(), reason="SGLang's Model Gateway is not installed (pip install 'sprig[gateway]')"
)
READY = re.compile(r"ready at (http://\S+)")
WORKER_UP = re.compile(r"worker (\d+) is up at (http://\S+) \(pid (\d+)\)")
GROUPS, PER_GROUP, SYSTEM, QUESTION, OUTPUT = 32, 4, 96, 8, 2
POOL = 4608  # KV slots per worker: every group's prompts (32 x (96 + 4 x 10) = 4352)
CONCURRENCY = 4
KEY = "gateway-test-key"  # the data-parallel server's, sent everywhere (a server without keys ignores it)
AUTH = {"Authorization": f"Bearer {KEY}"}
STARTUP_TIMEOUT_S = 180.0


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(8, 500) for _ in range(n)]

    systems = [ids(SYSTEM) for _ in range(GROUPS)]
    prompts = [system + ids(QUESTION) for system in systems for _ in range(PER_GROUP)]
    rng.shuffle(prompts)
    return prompts


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def hit_rate(url: str, prompts: list[list[int]]) -> float:
    """cached / prompt tokens over the responses, `CONCURRENCY` requests in flight."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outs = list(pool.map(lambda p: generate(url, p, OUTPUT), prompts))
    assert all(len(o["output_ids"]) == OUTPUT for o in outs)
    return sum(o["meta_info"]["cached_tokens"] for o in outs) / sum(o["meta_info"]["prompt_tokens"] for o in outs)


@contextmanager
def launched(*args: str) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """`python -m sprig.runtime ARGS` with API key `KEY` until its "ready at" line; SIGTERM
    after the block, which must stop it with exit code 0."""
    fd, name = tempfile.mkstemp(prefix="sprig-test-gateway-", suffix=".log")
    log = Path(name)
    proc = subprocess.Popen([sys.executable, "-m", "sprig.runtime", *args], stdout=fd, stderr=subprocess.STDOUT,
                            env=os.environ | {"OMP_NUM_THREADS": "1", "SPRIG_API_KEY": KEY})
    os.close(fd)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (match := READY.search(log.read_text())):
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.1)
        yield proc, match.group(1), log
    finally:
        started = descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"ignored SIGTERM:\n{log.read_text()}") from None
    assert code == 0, log.read_text()
    assert_gone(started, log)
    log.unlink()


def assert_gone(pids: set[int], log: Path, grace: float = 10.0) -> None:
    """Every process of `pids` exits within `grace` seconds (a grammar worker, say, exits
    once it sees its scheduler's pipe close)."""
    deadline = time.monotonic() + grace
    while alive := [pid for pid in pids if pid_alive(pid)]:
        assert time.monotonic() < deadline, f"still running: {alive}\n{log.read_text() if log.exists() else ''}"
        time.sleep(0.1)


# ---- without the gateway: what it reads, and how workers are started -------------------

def test_load_routes_count_what_is_in_flight(server: Server) -> None:
    kv_size = server.info()["model"]["kv_size"]
    loads = server.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    rank = loads["loads"][0]
    assert rank["max_total_num_tokens"] == kv_size and 0 <= rank["token_usage"] <= 1
    assert server.get("/get_load").json()["load"] == 0
    seen = []
    with ThreadPoolExecutor(1) as pool:  # 200 decode steps: polled many times over
        running = pool.submit(generate, server.url, [10, 11, 12], 200)
        while not running.done():
            seen.append(server.get("/get_load").json()["load"])
        assert running.result()["meta_info"]["completion_tokens"] == 200
    assert max(seen) == 1, seen
    server.wait_idle()
    assert server.get("/get_load").json()["load"] == 0


def test_workers_get_the_servers_settings(tmp_path) -> None:
    flags = ["--max-total-tokens", "640", "--chunked-prefill-size", "none", "--no-enable-jump-forward",
             "--shadow-attention", "--schedule-policy", "lpm", "--read-timeout", "2.5", "--served-model-name", "m",
             "--tp-size", "2", "--dist-timeout", "30"]
    server, engine = configs_from_args(build_parser().parse_args(["serve", "--model", str(tmp_path), *flags]))
    cmd = worker_command(str(tmp_path), dataclasses.replace(server, host="0.0.0.0", port=8000), engine, 3)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "0"
    worker_server, worker_engine = configs_from_args(build_parser().parse_args(cmd[3:]))
    assert worker_server == dataclasses.replace(server, host="127.0.0.1", port=0)
    assert worker_engine.scheduler == engine.scheduler
    assert worker_engine.runner == dataclasses.replace(engine.runner, cpu_threads=3)
    assert worker_engine.dist == engine.dist and engine.dist.tp_size == 2  # each worker its own TP group
    assert config_flags(server) == ["--served-model-name", "m", "--read-timeout", "2.5"]


def test_gateway_config_is_checked() -> None:
    with pytest.raises(ValueError, match="http://"):
        GatewayConfig(("127.0.0.1:8000",))
    with pytest.raises(ValueError, match="policy"):
        GatewayConfig(("http://a:1",), policy="fastest")
    argv = GatewayConfig(("http://a:1/", "http://b:2"), policy="round_robin", extra_args=("--cache-threshold", "0.5")).argv(7, 8)
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert argv[argv.index("--policy") + 1] == "round_robin" and argv[-2:] == ["--cache-threshold", "0.5"]


# ---- the real gateway -------------------------------------------------------------------

@dataclass
class DataParallelServer:
    url: str
    log: Path
    workers: list[str]  # URLs, by index
    pids: list[int]  # each worker's HTTP process


@pytest.fixture(scope="module")
def dp_server(tiny_llama: Path) -> Iterator[DataParallelServer]:
    """`sprig serve --dp-size 2` (two workers with `POOL` KV slots each, and the gateway,
    cache_aware; API key `KEY`) for the module. SIGTERM must then stop it with exit code 0,
    leaving no process it started and no socket directory behind."""
    args = ("serve", "--model", str(tiny_llama), "--dtype", "float32", "--port", "0", "--dp-size", "2",
            "--max-total-tokens", str(POOL))
    with launched(*args) as (proc, url, log):
        up = sorted((int(i), wurl, int(pid)) for i, wurl, pid in WORKER_UP.findall(log.read_text()))
        assert [i for i, _, _ in up] == [0, 1], log.read_text()
        infos = [httpx.get(wurl + "/get_server_info", headers=AUTH, timeout=TIMEOUT).json() for _, wurl, _ in up]
        processes = descendants(proc.pid)
        assert {pid for info in infos for pid in info["pids"].values()} <= processes
        for where in (url, up[0][1]):  # the gateway and the workers check the key
            assert httpx.post(where + "/generate", json={"text": "a"}, timeout=TIMEOUT).status_code == 401
        assert not [pid for pid in processes | {proc.pid} if KEY.encode() in cmdline(pid)]
        yield DataParallelServer(url, log, [wurl for _, wurl, _ in up], [pid for _, _, pid in up])
    assert_gone(processes, log)
    assert not [info["ipc_dir"] for info in infos if Path(info["ipc_dir"]).exists()]


def decoded(worker: str) -> int:
    return httpx.get(worker + "/get_server_info", headers=AUTH, timeout=TIMEOUT).json()["stats"]["decode_tokens"]


def flush(workers: list[str]) -> None:
    for worker in workers:
        assert httpx.post(worker + "/flush_cache", headers=AUTH, timeout=TIMEOUT).status_code == 200


@needs_gateway
def test_cache_aware_routing_keeps_the_hit_rate_round_robin_loses(dp_server: DataParallelServer) -> None:
    """The one-server rate is worker 0's, sent every prompt itself: its pool holds every group."""
    prompts = shared_prefix_prompts()
    flush(dp_server.workers[:1])
    one = hit_rate(dp_server.workers[0], prompts)
    rates, shares = {}, {}
    for policy in ("cache_aware", "round_robin"):
        flush(dp_server.workers)
        before = [decoded(w) for w in dp_server.workers]
        if policy == "cache_aware":  # the gateway `--dp-size` started
            rates[policy] = hit_rate(dp_server.url, prompts)
        else:  # `sprig router` in front of the same workers
            with launched("router", "--worker-urls", *dp_server.workers, "--port", "0", "--policy", policy) as (_, url, _):
                rates[policy] = hit_rate(url, prompts)
        shares[policy] = [decoded(w) - b for w, b in zip(dp_server.workers, before, strict=True)]
        assert all(shares[policy]), f"{policy} left a worker idle: {shares[policy]}"
    print(f"prefix hit rate: one server {one:.1%}, cache_aware {rates['cache_aware']:.1%}, "
          f"round_robin {rates['round_robin']:.1%}")
    # One server computes each system prompt once: 3 of a group's 4 prompts hit, 69.2%. A group
    # computed twice costs 0.7 points. Round robin sends each prompt to either worker about
    # evenly, so 7 groups in 8 are computed on both: 49.0% expected, +-1.4 points (one sd).
    assert abs(rates["cache_aware"] - one) <= 0.03, (one, rates, "tokens decoded per worker:", shares)
    assert rates["cache_aware"] >= rates["round_robin"] + 0.15, (one, rates, "tokens decoded per worker:", shares)


@needs_gateway
def test_responses_behind_the_gateway_are_not_stored_so_never_continued_by_chance(
        dp_server: DataParallelServer) -> None:
    """Each worker would keep its own responses and the gateway routes a continuation to
    any worker: the workers keep none, so `previous_response_id` is a 404 saying to send
    the conversation, on every route, and a response says it was not stored."""
    model = httpx.get(dp_server.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()["data"][0]["id"]
    body = {"model": model, "input": "a b c", "max_output_tokens": 4, "temperature": 0}
    first = httpx.post(dp_server.url + "/v1/responses", json=body, headers=AUTH, timeout=TIMEOUT)
    assert first.status_code == 200 and first.json()["store"] is False, first.text
    for _ in range(4):  # both workers, whatever the policy
        r = httpx.post(dp_server.url + "/v1/responses", json={**body, "previous_response_id": first.json()["id"]},
                       headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 404 and "send the conversation as input" in r.json()["error"]["message"], r.text


@needs_gateway
def test_anthropic_messages_go_through_the_gateway(dp_server: DataParallelServer) -> None:
    """smg routes Anthropic's `/v1/messages` (whole and streamed) and its count_tokens to
    the workers, whose answer is the worker's own. smg 1.13 takes the key only as
    `Authorization: Bearer` (the anthropic client's `auth_token`), not as `x-api-key`."""
    model = httpx.get(dp_server.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": "a b c"}], "temperature": 0}
    refused = httpx.post(dp_server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=TIMEOUT)
    assert refused.status_code == 401 and "Bearer" in refused.text, refused.text
    via = httpx.post(dp_server.url + "/v1/messages", json=body, headers=AUTH, timeout=TIMEOUT)
    direct = httpx.post(dp_server.workers[0] + "/v1/messages", json=body, headers=AUTH, timeout=TIMEOUT)
    assert via.status_code == 200 and via.json()["type"] == "message", via.text
    assert via.json()["content"] == direct.json()["content"] and via.json()["stop_reason"] == "max_tokens"
    with httpx.stream("POST", dp_server.url + "/v1/messages", json={**body, "stream": True}, headers=AUTH,
                      timeout=TIMEOUT) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    counted = httpx.post(dp_server.url + "/v1/messages/count_tokens", json=body, headers=AUTH, timeout=TIMEOUT)
    usage = via.json()["usage"]
    assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}


@needs_gateway
def test_scoring_goes_to_a_worker_since_the_gateway_does_not_route_it(dp_server: DataParallelServer) -> None:
    """smg 1.13 has no `/v1/score` route (README, Data parallelism); a worker answers it.
    `/v1/embeddings` it routes."""
    body = {"model": "any", "query": "a b", "items": [" c", " d"], "label_token_ids": [5, 6]}
    r = httpx.post(dp_server.url + "/v1/score", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 404 and "/v1/score" in r.text, r.text
    assert "does not route /v1/score" in dp_server.log.read_text()
    r = httpx.post(dp_server.workers[0] + "/v1/score", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200 and len(r.json()["scores"]) == 2, r.text
    model = httpx.get(dp_server.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()["data"][0]["id"]
    r = httpx.post(dp_server.url + "/v1/embeddings", json={"model": model, "input": ["a b", "c"]}, headers=AUTH,
                   timeout=TIMEOUT)  # embeddings it routes, by the model's name
    assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == [0, 1], r.text


@needs_gateway
def test_weight_updates_go_to_each_worker_since_the_gateway_does_not_route_them(
        tiny_llama: Path, dp_server: DataParallelServer, tmp_path: Path) -> None:
    """smg 1.13 has no `/update_weights_from_disk` route (README, Data parallelism): each
    worker is updated at its own URL, then the gateway and every worker answer what
    transformers generates with the new weights, labelled with their version."""
    new = perturbed_copy(tiny_llama, tmp_path / "new", seed=1)
    r = httpx.post(dp_server.url + "/update_weights_from_disk", json={"model_path": str(new)}, headers=AUTH,
                   timeout=TIMEOUT)
    assert r.status_code == 404 and "/update_weights_from_disk" in r.text, r.text
    assert "does not route /update_weights_from_disk" in dp_server.log.read_text()
    prompt = [5, 17, 230, 41]
    expected = hf_greedy_ids(new, prompt, 6)
    try:
        for worker in dp_server.workers:
            r = httpx.post(worker + "/update_weights_from_disk", json={"model_path": str(new), "weight_version": "v1"},
                           headers=AUTH, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["success"], r.text
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        for where in [dp_server.url, *dp_server.workers]:
            out = httpx.post(where + "/generate", json=body, headers=AUTH, timeout=TIMEOUT).json()
            assert out["output_ids"] == expected and out["meta_info"]["weight_version"] == "v1", where
    finally:
        for worker in dp_server.workers:
            httpx.post(worker + "/update_weights_from_disk", json={"model_path": str(tiny_llama),
                       "weight_version": "default"}, headers=AUTH, timeout=TIMEOUT)


def hf_greedy_ids(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_gateway
def test_a_worker_that_dies_loses_no_request_that_had_not_started_on_it(dp_server: DataParallelServer) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 500) for _ in range(24)] for _ in range(48)]
    finished = threading.Semaphore(0)

    def one(prompt: list[int]) -> tuple[float, float, int]:
        start = time.monotonic()
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
        status = httpx.post(dp_server.url + "/generate", json=body, headers=AUTH, timeout=TIMEOUT).status_code
        finished.release()
        return start, time.monotonic(), status

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        for _ in range(12):
            finished.acquire()
        os.kill(dp_server.pids[1], signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result() for f in futures]
    lost = [(start, end) for start, end, status in results if status != 200]
    assert all(start < killed < end for start, end in lost), lost  # only requests already running
    assert sum(start > killed for start, _, _ in results) >= 24
    log = dp_server.log.read_text()
    assert re.search(r"worker 1 \(http://\S+\) exited with code -9", log), log
    deadline = time.monotonic() + 30
    while [w["is_healthy"] for w in httpx.get(dp_server.url + "/workers", headers=AUTH, timeout=TIMEOUT).json()["workers"]
           if w["url"] == dp_server.workers[1]] != [False]:
        assert time.monotonic() < deadline, "the gateway still routes to the dead worker"
        time.sleep(0.5)
    assert generate(dp_server.url, prompts[0], 4)["meta_info"]["completion_tokens"] == 4
