"""A server with an API key and tight limits: 401 without the key, 413 past the body
limit, 400 from the scheduler's own rejection, 429 past the in-flight bound; two servers
at once; SIGINT stops everything cleanly. (A child that dies or hangs: test_server_liveness.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import TIMEOUT, Server, pid_alive, running_server

KEY = "s3cret"
LIMITS = ("--max-running-requests", "1", "--max-queued-requests", "1", "--max-request-bytes", "4096",
          "--max-total-tokens", "512")
OK = {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def limited(tiny_llama: Path):
    with running_server(tiny_llama, *LIMITS, api_key=KEY) as s:
        yield s


def test_api_key_is_required_except_for_health(limited: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = limited.post("/generate", OK, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert limited.get("/v1/models", headers={}).status_code == 401
    assert limited.get("/health", headers={}).status_code == 200
    assert limited.get("/metrics", headers={}).status_code == 200
    assert limited.post("/generate", OK).status_code == 200
    limited.wait_idle()


def test_the_api_key_shows_in_no_process_command_line(limited: Server) -> None:
    for pid in limited.pids.values():
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_body_size_limit(limited: Server) -> None:
    big = {"text": "x" * 5000}
    assert limited.post("/generate", big).status_code == 413
    chunks = (b'{"text": "' + b"x" * 1000 for _ in range(6))  # chunked: no Content-Length
    r = httpx.post(limited.url + "/generate", content=chunks, headers=limited.headers, timeout=TIMEOUT)
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert limited.post("/generate", OK).status_code == 200
    limited.wait_idle()


def test_scheduler_rejections_come_back_as_400(limited: Server) -> None:
    r = limited.post("/generate", {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 300}})
    assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]
    assert limited.post("/generate", OK).status_code == 200
    limited.wait_idle()


def test_past_the_in_flight_bound_a_call_is_refused_whole_with_429(limited: Server) -> None:
    """--max-queued-requests 1: one sequence in flight at most. Concurrent calls beyond it
    get 429 with Retry-After, and a call larger than the bound is a 400; neither leaves
    anything running."""
    body = {"text": "the cat", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: limited.post("/generate", body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses and set(statuses) == {200, 429}, statuses
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and "retry later" in busy.json()["error"]["message"]
    two = limited.post("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert two.status_code == 400 and "at most 1 sequences" in two.json()["error"]["message"]
    limited.wait_idle()
    assert limited.post("/generate", OK).status_code == 200
    limited.wait_idle()


def test_two_servers_at_once(limited: Server, server: Server) -> None:
    assert limited.url != server.url and limited.ipc_dir != server.ipc_dir
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda s: s.post("/generate", OK), (limited, server))
    assert a.status_code == b.status_code == 200
    limited.wait_idle()
    server.wait_idle()


def test_sigint_stops_everything_cleanly(limited: Server) -> None:
    assert limited.stop(signal.SIGINT) == 0
    assert not [pid for pid in limited.pids.values() if pid_alive(pid)] and not Path(limited.ipc_dir).exists()


def test_the_forkservers_exit_hook_does_nothing_where_else_it_is_imported() -> None:
    """`forkserver_exit` ends the forkserver at once; imported by any other process it must
    leave that process's exit alone (its status, and what it still has to print)."""
    code = "import sprig.runtime.server.forkserver_exit, sys; print('flushed at exit', end=''); sys.exit(3)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "flushed at exit"), done.stderr
