"""A child process that dies or stops making progress is fatal and visible: requests in
flight fail with 503 at once, /health answers 503, and the server exits non-zero naming
the process, leaving no process and no socket directory behind; if the server process
itself is killed outright, the children exit and remove the socket directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from server_helpers import TIMEOUT, Server, parse_event, pid_alive, running_server

OK = {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}


def wait_for_exit(server: Server, timeout: float) -> int:
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server is still running:\n{server.log.read_text()}") from None


def health_or_gone(server: Server) -> int | None:
    """/health's status, or None once the server has closed its port."""
    try:
        return server.get("/health").status_code
    except httpx.TransportError:
        return None


def test_a_killed_scheduler_fails_requests_at_once_and_the_server_exits_1(tiny_llama: Path) -> None:
    with running_server(tiny_llama, exit_code=1) as server:
        body = {"text": "the cat", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert parse_event(next(line for line in lines if line))["meta_info"]["finish_reason"] is None
            os.kill(server.pids["scheduler"], signal.SIGKILL)
            events = [parse_event(line) for line in lines if line]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503, events[-2:]
        assert "scheduler process" in events[-2]["error"]["message"]
        assert health_or_gone(server) in (503, None)
        assert wait_for_exit(server, 30) == 1
        assert "the scheduler process" in server.log.read_text()


def test_a_stopped_scheduler_is_noticed_by_the_watchdog(tiny_llama: Path) -> None:
    """SIGSTOP: the process is alive but makes no progress. With --watchdog-timeout 2 (the
    least it takes) the server answers 503, kills it (a stopped process ignores SIGTERM) and
    exits 1 within seconds."""
    with running_server(tiny_llama, "--watchdog-timeout", "2", exit_code=1) as server:
        assert server.post("/generate", OK).status_code == 200
        os.kill(server.pids["scheduler"], signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while health_or_gone(server) == 200:
                assert time.monotonic() < deadline, "/health stayed 200 with a stopped scheduler"
                time.sleep(0.2)
            assert wait_for_exit(server, 30) == 1
        finally:
            if pid_alive(server.pids["scheduler"]):
                os.kill(server.pids["scheduler"], signal.SIGCONT)
        log = server.log.read_text()
        assert "no sign of life" in log and "did not stop on SIGTERM" not in log, log


def test_children_exit_and_clean_up_when_the_server_process_is_killed(tiny_llama: Path) -> None:
    with running_server(tiny_llama, exit_code=-signal.SIGKILL) as server:
        os.kill(server.pids["http"], signal.SIGKILL)
        assert server.proc.wait(10) == -signal.SIGKILL
        children = [server.pids["scheduler"], server.pids["detokenizer"]]
        deadline = time.monotonic() + 20
        while any(pid_alive(pid) for pid in children) or Path(server.ipc_dir).exists():
            assert time.monotonic() < deadline, "a child outlived the server, or the ipc directory stayed"
            time.sleep(0.2)
