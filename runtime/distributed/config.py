"""Tensor-parallel settings: how many ranks, over how many nodes, meeting where."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DIST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistConfig:
    """`tp_size` ranks split evenly over `nnodes` nodes: node n runs ranks
    `n * per_node .. (n + 1) * per_node - 1`, rank 0 (the scheduler's) on node 0.
    `dist_init_addr` ("host:port") is where rank 0 listens for the others to meet; needed
    with several nodes (on one node a free port of 127.0.0.1 is used). `dist_timeout` bounds,
    in seconds, every collective inside a step, so a stuck rank fails the step instead of
    hanging it (starting ranks have longer: `group.JOIN_TIMEOUT_S`)."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must be >= 1 and divide tp_size ({self.tp_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (host:port of node 0) is needed with more than one node")
        if self.dist_init_addr is not None:
            self.address()  # validates it
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_ranks(self) -> range:
        """The ranks this node runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def address(self) -> tuple[str, int]:
        """`dist_init_addr` as (host, port); ValueError if it is not host:port."""
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        return host.strip("[]"), int(port)
