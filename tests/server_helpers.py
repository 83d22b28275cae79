"""Starting the real server for end-to-end tests: `sprig serve` in a subprocess on
127.0.0.1 with a free port (port 0), every request bounded by a timeout."""

from __future__ import annotations

import os
import re
import shutil
import signal
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
import orjson

TIMEOUT = httpx.Timeout(30.0, connect=5.0)
STARTUP_TIMEOUT_S = 120.0
READY = re.compile(r"ready at (http://\S+)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    headers: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)  # http, scheduler, detokenizer
    descendants: set[int] = field(default_factory=set)  # every process the server started
    ipc_dir: str = ""

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=TIMEOUT, **({"headers": self.headers} | kw))

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT, **({"headers": self.headers} | kw))

    def generate(self, body: dict[str, Any]) -> Any:
        r = self.post("/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, body: dict[str, Any], **kw: Any) -> list[Any]:
        """Every SSE event of a streamed response, parsed ("[DONE]" kept as a string)."""
        with httpx.stream("POST", self.url + path, json=body, timeout=TIMEOUT, headers=self.headers, **kw) as r:
            assert r.status_code == 200, r.read()
            return [parse_event(line) for line in r.iter_lines() if line]

    def info(self) -> dict[str, Any]:
        return self.get("/get_server_info").json()

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until no request is in flight; then the KV check must pass and every slot
        be free or evictable."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.get("/debug/check_integrity").json()
            if state["running"] == state["waiting"] == state["live"] == 0:
                break
            assert time.monotonic() < deadline, f"requests still in flight: {state}"
            time.sleep(0.1)
        assert state["ok"], state
        assert state["kv_protected"] == 0 and state["rows_available"] == state["rows"], state
        assert state["kv_available"] + state["kv_evictable"] == state["kv_size"], state
        return state

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server ignored {signal.Signals(sig).name}:\n{self.log.read_text()}") from None


def parse_event(line: str) -> Any:
    assert line.startswith("data: "), line
    payload = line[len("data: ") :]
    return payload if payload == "[DONE]" else orjson.loads(payload)


@contextmanager
def running_server(model: Path, *args: str, api_key: str | None = None, exit_code: int = 0) -> Iterator[Server]:
    """A server for the duration of the block. After it (unless the block stopped the
    server itself) SIGTERM must stop it with `exit_code`, leaving no process, no ipc
    directory and (unless it was killed) nothing in its temporary directory behind."""
    fd, log_name = tempfile.mkstemp(prefix="sprig-test-server-", suffix=".log")
    log = Path(log_name)
    tmp = Path(tempfile.mkdtemp(prefix="sprig-test-tmp-"))
    cmd = [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(model), "--port", "0",
           "--dtype", "float32", "--log-interval", "1", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}  # 2 shared cores: threads only contend
    if api_key:
        env["SPRIG_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env=env)
    os.close(fd)
    server = Server(proc, _wait_ready(proc, log), log, {"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        info = server.info()
        server.pids, server.ipc_dir = info["pids"], info["ipc_dir"]
        server.descendants = descendants(proc.pid)
        assert {server.pids["scheduler"], server.pids["detokenizer"]} <= server.descendants
        assert Path(server.ipc_dir).is_dir() and Path(server.ipc_dir).stat().st_mode & 0o777 == 0o700
        yield server
    finally:
        code = server.stop()
    assert code == exit_code, log.read_text()
    assert not [name for name, pid in server.pids.items() if pid_alive(pid)], log.read_text()
    assert not Path(server.ipc_dir).exists()
    deadline = time.monotonic() + 10  # the forkserver and its helpers exit as they see the server gone
    while left := [pid for pid in server.descendants if pid_alive(pid)]:
        assert time.monotonic() < deadline, f"processes outlived the server: {[cmdline(p)[:200] for p in left]}"
        time.sleep(0.1)
    if exit_code >= 0:  # a process killed outright leaves what its exit handlers would remove
        assert not list(tmp.iterdir()), f"left in its temporary directory: {list(tmp.rglob('*'))}"
    shutil.rmtree(tmp)
    log.unlink()


def _wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if match := READY.search(log.read_text()):
            return match.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not start in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent pid, ...);
    None once the process is gone (before the open, or between it and the read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (fields := _stat(int(stat.parent.name))) is not None:
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cmdline(pid: int) -> bytes:
    """The command line of `pid`, its arguments NUL-separated (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"
