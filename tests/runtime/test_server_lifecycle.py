"""A server with an API key and tight limits: 401 without the key, 413 past the body
limit, 400 from the scheduler's own rejection, 503 past the queue limit; two servers at
once; and, last (it breaks this module's server), a killed scheduler fails pending requests
and /health promptly, and SIGINT still stops everything cleanly."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import TIMEOUT, Server, parse_event, pid_alive, running_server

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


def test_queue_limit_is_a_503(limited: Server) -> None:
    body = {"text": "the cat", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: limited.post("/generate", body), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses and set(statuses) == {200, 503}, statuses
    busy = next(r for r in responses if r.status_code == 503).json()["error"]
    assert "max_queued_requests" in busy["message"] and busy["type"] == "service_unavailable_error"
    assert limited.post("/generate", OK).status_code == 200
    limited.wait_idle()


def test_two_servers_at_once(limited: Server, server: Server) -> None:
    assert limited.url != server.url and limited.ipc_dir != server.ipc_dir
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda s: s.post("/generate", OK), (limited, server))
    assert a.status_code == b.status_code == 200
    limited.wait_idle()
    server.wait_idle()


def test_killed_scheduler_fails_requests_promptly_then_sigint_stops_all(limited: Server) -> None:
    body = {"text": "the cat", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", limited.url + "/generate", json=body, headers=limited.headers, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert parse_event(next(line for line in lines if line))["meta_info"]["finish_reason"] is None
        killed = time.monotonic()
        os.kill(limited.pids["scheduler"], signal.SIGKILL)
        events = [parse_event(line) for line in lines if line]
    assert time.monotonic() - killed < 5.0
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-2:]
    assert "scheduler process" in events[-2]["error"]["message"]
    health = limited.get("/health")
    assert health.status_code == 503 and "scheduler" in health.json()["error"]["message"]
    started = time.monotonic()
    assert limited.post("/generate", OK).status_code == 503
    assert time.monotonic() - started < 2.0
    assert limited.stop(signal.SIGINT) == 0
    assert not pid_alive(limited.pids["detokenizer"]) and not Path(limited.ipc_dir).exists()
