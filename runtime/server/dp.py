"""Data parallelism on one machine: `sprig serve --dp-size N` runs N full `sprig serve`
workers (each its own HTTP, scheduler and detokenizer processes, on 127.0.0.1 and a free
port) and SGLang's Model Gateway in front of them on the requested host and port.

This process supervises them all. It starts the workers, relays their logs (prefixed
"[worker i]"), waits until each is ready, starts the gateway and waits until the gateway
routes to every worker, then logs "ready at URL" (the gateway's). A worker that exits is
reported; the gateway's own health checks take it out of rotation and its traffic goes
to the others. The gateway exiting, or the last worker, stops everything (exit 1).
SIGINT or SIGTERM stops the gateway, then the workers, each of which removes its own
socket directory; the workers and the gateway also get SIGTERM from the kernel if this
process dies without stopping them (Linux).

On CPU each worker gets an equal share of the cores as torch threads unless
`--cpu-threads` is given; on CUDA worker i runs on the i-th visible GPU when there are at
least N of them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.processes import die_with_parent
from sprig.runtime.server.child import setup_logging
from sprig.runtime.server.config import ServerConfig
from sprig.runtime.server.dp_config import DataParallelConfig, GatewayConfig
from sprig.runtime.server.gateway import Gateway
from sprig.runtime.server.stop_signals import exit_on_stop_signals, ignore_stop_signals

log = logging.getLogger("sprig.dp")
READY = re.compile(r"ready at (http://\S+)")
WORKER_HOST = "127.0.0.1"
WORKER_STOP_TIMEOUT_S = 30.0
GATEWAY_READY_TIMEOUT_S = 120.0
POLL_S = 0.2


def config_flags(config: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """The `sprig serve` flags that reproduce `config`'s fields that differ from their
    defaults (flag names are field names, as the CLI builds them)."""
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            flags += [flag, "none"]
        elif isinstance(value, (int, float, str)):
            flags += [flag, str(value)]
        else:
            raise TypeError(f"cannot pass {f.name}={value!r} to a worker as a flag")
    return flags


def worker_command(model_path: str, server: ServerConfig, engine: EngineConfig, cpu_threads: int | None) -> list[str]:
    """`sprig serve` for one worker: the same settings, on 127.0.0.1 and a free port."""
    runner = engine.runner
    if cpu_threads is not None and runner.cpu_threads is None:
        runner = dataclasses.replace(runner, cpu_threads=cpu_threads)
    return [
        sys.executable, "-m", "sprig.runtime", "serve", "--model", model_path, "--host", WORKER_HOST, "--port", "0",
        *config_flags(server, frozenset({"host", "port", "api_keys"})),
        *config_flags(runner, frozenset({"model_path"})), *config_flags(engine.scheduler), *config_flags(engine.dist),
    ]


def worker_devices(device: str, n: int, ranks: int = 1) -> tuple[list[str | None], int | None]:
    """(CUDA_VISIBLE_DEVICES for each worker, or None to inherit; torch CPU threads per
    worker rank, or None for the default): `ranks` GPUs each (one per tensor-parallel
    rank) when there are `n * ranks`, else shared."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(ids) >= n * ranks:
            return [",".join(ids[i * ranks : (i + 1) * ranks]) for i in range(n)], None
        log.warning("%d workers share %d GPU(s)", n, len(ids))
        return [None] * n, None
    return [None] * n, max(1, (os.cpu_count() or 1) // (n * ranks)) if device in ("auto", "cpu") else None


class Worker:
    """One `sprig serve` child; its output is relayed line by line, and its "ready at"
    line sets `url`."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str]) -> None:
        self.index, self.url, self.reported = index, None, False
        self.ready = threading.Event()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     preexec_fn=functools.partial(die_with_parent, os.getpid()))

    def relay(self) -> None:
        threading.Thread(target=self._relay, name=f"sprig-worker-{self.index}-log", daemon=True).start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if self.url is None and (match := READY.search(line)):
                self.url = match.group(1)
                self.ready.set()
                log.info("worker %d is up at %s (pid %d)", self.index, self.url, self.proc.pid)
                continue
            sys.stderr.write(f"[worker {self.index}] {line}\n")
        self.ready.set()  # the worker exited: nobody waits on it

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()


def launch_data_parallel(model_path: str, server: ServerConfig, engine: EngineConfig, dp: DataParallelConfig) -> None:
    """Serve through the gateway until SIGINT or SIGTERM. Raises `RuntimeError` if a worker
    or the gateway cannot start, the gateway exits, or every worker has exited."""
    setup_logging(server.log_level)
    exit_on_stop_signals()
    if len(server.api_keys) > 1:
        raise ValueError("--dp-size takes at most one API key (the gateway checks one)")
    if engine.dist.nnodes > 1 or engine.dist.dist_init_addr is not None:
        raise ValueError("--dp-size starts each worker's tensor-parallel group on this machine: "
                         "no --nnodes or --dist-init-addr")
    key = server.api_keys[0] if server.api_keys else None
    gpus, threads = worker_devices(engine.runner.device, dp.dp_size, engine.dist.tp_size)
    # each worker would keep its own responses, and the gateway does not send a continuation
    # to the worker that made the response it continues: none keeps any (`previous_response_id`
    # is then always a 404 saying so, never one that depends on the route)
    log.info("/v1/responses are not stored behind the gateway: send each conversation as input")
    log.info("the gateway does not route /v1/score: send scoring calls to a worker's own URL")
    log.info("the gateway does not route /update_weights_from_disk or /update_weight_version: send them to every "
             "worker's own URL")
    cmd = worker_command(model_path, dataclasses.replace(server, responses_store_bytes=0), engine, threads)
    workers: list[Worker] = []
    gateway: Gateway | None = None
    try:
        for i, gpu in enumerate(gpus):  # every fork before the first relay thread starts
            env = os.environ | ({"SPRIG_API_KEY": key} if key else {}) | ({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})
            workers.append(Worker(i, cmd, env))
        for w in workers:
            w.relay()
        urls = _await_workers(workers)
        gateway = Gateway(GatewayConfig(tuple(urls), server.host, server.port, dp.router_policy, api_key=key,
                                        log_level=server.log_level))
        gateway.start()
        gateway.wait_ready(GATEWAY_READY_TIMEOUT_S)
        log.info("sprig data-parallel server ready at %s (gateway, policy %s, in front of %d workers: %s)",
                 gateway.url, dp.router_policy, len(urls), ", ".join(urls))
        _supervise(workers, gateway)
    finally:
        ignore_stop_signals()
        if gateway is not None:
            gateway.stop()
        _stop_workers(workers)
        log.info("data-parallel server stopped")


def _await_workers(workers: list[Worker]) -> list[str]:
    for w in workers:
        w.ready.wait()
        if w.url is None:
            code = w.proc.wait()
            raise RuntimeError(f"worker {w.index} exited during startup (exit code {code})")
    return [w.url for w in workers if w.url is not None]


def _supervise(workers: list[Worker], gateway: Gateway) -> None:
    """Return never: report each worker that exits; raise once the gateway or every worker
    has exited."""
    while True:
        if not gateway.alive():
            raise RuntimeError(f"the gateway exited (exit code {gateway.exitcode()})")
        for w in workers:
            if not w.reported and (code := w.proc.poll()) is not None:
                w.reported = True
                left = sum(x.proc.poll() is None for x in workers)
                log.error("worker %d (%s) exited with code %d; the gateway takes it out of rotation and "
                          "sends its traffic to the %d worker(s) left", w.index, w.url, code, left)
        if all(w.reported for w in workers):
            raise RuntimeError("every worker has exited")
        time.sleep(POLL_S)


def _stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        w.stop()
    deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
    for w in workers:
        try:
            w.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("worker %d did not stop on SIGTERM; killing it", w.index)
            w.proc.kill()
            w.proc.wait(5.0)
