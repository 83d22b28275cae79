"""SGLang's Model Gateway (`smg`, an optional dependency: `pip install 'sprig[gateway]'`) in
front of sprig servers, as one supervised child process.

The gateway discovers each worker from its `/server_info`, `/model_info` and `/v1/models`,
probes `/health` every `health_check_interval` seconds (a worker failing two probes in a
row is taken out of rotation), polls `/v1/loads`, and retries a request that could not
reach a worker on another one. Its `cache_aware` policy keeps an approximate radix tree
of the prompts (text, or token ids as text) it sent to each worker and sends a request to
the worker holding the longest prefix of it, unless that worker is far busier than the
rest.

The gateway runs in a "spawn" child of the supervising process and reads its options
from there, not from a command line: an API key never shows in `ps`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing as mp
import os
import signal
import time
import urllib.request
from multiprocessing.process import BaseProcess

from sprig.runtime.processes import die_with_parent, free_port
from sprig.runtime.server.child import setup_logging
from sprig.runtime.server.dp_config import GatewayConfig
from sprig.runtime.server.stop_signals import exit_on_stop_signals, ignore_stop_signals

log = logging.getLogger("sprig.gateway")
GATEWAY_STOP_TIMEOUT_S = 10.0
ROUTER_READY_TIMEOUT_S = 1800.0  # the gateway's own wait for workers that start after it
INSTALL_HINT = "the gateway is not installed: pip install 'sprig[gateway]' (or: pip install smg)"


def gateway_installed() -> bool:
    return importlib.util.find_spec("smg") is not None


class Gateway:
    """The gateway process. `start`, then `wait_ready` (every worker registered and
    healthy), then `stop` (SIGTERM, SIGKILL after `GATEWAY_STOP_TIMEOUT_S`)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.port = config.port or free_port(config.host)
        self.url = f"http://{f'[{config.host}]' if ':' in config.host else config.host}:{self.port}"
        self.proc: BaseProcess | None = None

    def start(self) -> None:
        if not gateway_installed():
            raise RuntimeError(INSTALL_HINT)
        argv = self.config.argv(self.port, free_port(self.config.host))
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=_run_gateway, args=(argv, os.getpid()), name="sprig-gateway", daemon=True)
        self.proc.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def workers(self) -> dict[str, bool]:
        """Each worker URL the gateway has registered, and whether it routes to it now."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + "/workers", headers=headers), timeout=5.0) as r:
            listed = json.loads(r.read())["workers"]
        return {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in listed}

    def wait_ready(self, timeout: float) -> None:
        """Return once every worker is registered and healthy; `RuntimeError` if the
        gateway exits or `timeout` seconds pass first."""
        wanted = {u.rstrip("/") for u in self.config.worker_urls}
        deadline, healthy = time.monotonic() + timeout, set()
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the gateway exited during startup (exit code {self.exitcode()})")
            try:
                healthy = {url for url, ok in self.workers().items() if ok}
            except (OSError, ValueError, KeyError):  # not listening yet; URLError is an OSError
                healthy = set()
            if wanted <= healthy:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not register {sorted(wanted - healthy)} within {timeout:g} s")

    def exitcode(self) -> int | None:
        return None if self.proc is None else self.proc.exitcode

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(GATEWAY_STOP_TIMEOUT_S)
        if self.proc.is_alive():
            log.warning("the gateway did not stop on SIGTERM; killing it")
            self.proc.kill()
            self.proc.join(2.0)


def serve_gateway(config: GatewayConfig) -> None:
    """`sprig router`: the gateway in front of servers started elsewhere, until SIGINT or
    SIGTERM. Logs "ready at URL" once it routes to every worker; raises `RuntimeError`
    if it cannot start or exits on its own."""
    setup_logging(config.log_level)
    exit_on_stop_signals()
    gateway = Gateway(config)
    try:
        gateway.start()
        log.info("waiting for the gateway to register %d worker(s)", len(config.worker_urls))
        gateway.wait_ready(ROUTER_READY_TIMEOUT_S)
        log.info("sprig router ready at %s (policy %s, workers: %s)", gateway.url, config.policy,
                 ", ".join(config.worker_urls))
        while gateway.alive():
            time.sleep(0.2)
        raise RuntimeError(f"the gateway exited (exit code {gateway.exitcode()})")
    finally:
        ignore_stop_signals()
        gateway.stop()


def _run_gateway(argv: list[str], parent: int) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group; the supervisor decides
    from smg.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(argv))
