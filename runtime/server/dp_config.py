"""Data parallelism's settings: `sprig serve --dp-size N`'s (`DataParallelConfig`) and
those of SGLang's Model Gateway in front of the workers (`GatewayConfig`, also `sprig
router`'s), with the names their options take. Nothing heavy is imported: the CLI builds
its flags from these; `dp` and `gateway` run them."""

from __future__ import annotations

from dataclasses import dataclass

from sprig.runtime.server.config import LOG_LEVELS

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
GATEWAY_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}  # its info is chatty
HEALTH_FAILURE_THRESHOLD = 2


@dataclass(frozen=True)
class DataParallelConfig:
    """- `dp_size`: workers behind the gateway; 1 serves alone, without a gateway.
    - `router_policy`: the gateway's routing policy (`ROUTER_POLICIES`)."""

    dp_size: int = 1
    router_policy: str = "cache_aware"

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, got {self.router_policy!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway listens and routes.

    - `worker_urls`: the sprig servers behind it (`http://host:port`).
    - `port`: 0 picks a free port (the "ready at" log line names it).
    - `policy`: one of `ROUTER_POLICIES`; `cache_aware` sends a request to the worker
      whose cache most likely holds its prefix.
    - `health_check_interval`: seconds between the gateway's `/health` probes of each
      worker; a worker failing `HEALTH_FAILURE_THRESHOLD` in a row gets no more traffic.
    - `api_key`: when set, clients must send `Authorization: Bearer <api_key>` and the
      gateway sends it to the workers (which must accept it).
    - `extra_args`: more `smg launch` flags, passed as given (they win over the above).
    """

    worker_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    health_check_interval: int = 2
    api_key: str | None = None
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ValueError("the gateway needs at least one worker URL")
        if bad := [u for u in self.worker_urls if not u.startswith(("http://", "https://"))]:
            raise ValueError(f"worker URLs must start with http:// or https://, got {bad[0]!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {ROUTER_POLICIES}, got {self.policy!r}")
        if self.health_check_interval < 1:
            raise ValueError(f"health_check_interval must be >= 1 s, got {self.health_check_interval}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")

    def argv(self, port: int, metrics_port: int) -> list[str]:
        """The gateway's `smg launch` arguments, on `port` (resolved from 0)."""
        argv = [
            "--worker-urls", *(u.rstrip("/") for u in self.worker_urls), "--host", self.host, "--port", str(port),
            "--policy", self.policy, "--log-level", GATEWAY_LOG_LEVELS[self.log_level],
            "--health-check-interval-secs", str(self.health_check_interval),
            "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD), "--worker-startup-check-interval", "1",
            "--prometheus-host", self.host, "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", "5",
        ]
        return argv + (["--api-key", self.api_key] if self.api_key else []) + list(self.extra_args)
