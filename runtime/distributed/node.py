"""A node other than node 0 (`sprig serve --node-rank N`): no server, no scheduler, just
this node's tensor-parallel ranks, until rank 0 stops them or the group fails."""

from __future__ import annotations

import logging
import subprocess

from sprig.runtime.distributed.config import DistConfig
from sprig.runtime.distributed.rank import check_devices, run_rank, spawn_rank
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.server.child import setup_logging

log = logging.getLogger("sprig.tp")


def serve_node(config: RunnerConfig, dist: DistConfig, log_level: str = "info") -> None:
    """Run this node's first rank here and the rest as child processes; returns when rank 0
    has sent stop and every rank has exited; `RuntimeError` naming the rank otherwise."""
    setup_logging(log_level)
    check_devices(config, dist)
    address = dist.address()
    first, *rest = dist.node_ranks()
    log.info("node %d of %d: tensor-parallel ranks %s, meeting rank 0 at %s:%d",
             dist.node_rank, dist.nnodes, list(dist.node_ranks()), *address)
    children: dict[int, subprocess.Popen] = {rank: spawn_rank(config, dist, rank, address) for rank in rest}
    try:
        run_rank(config, dist, first, address)
    except BaseException as e:
        for proc in children.values():
            proc.kill()
            proc.wait()
        raise RuntimeError(f"tensor-parallel rank {first} failed: {e}") from e
    codes = {rank: proc.wait() for rank, proc in children.items()}
    failed = {rank: code for rank, code in codes.items() if code != 0}
    if failed:
        raise RuntimeError(f"tensor-parallel ranks exited with codes {failed}")
    log.info("node %d: rank 0 stopped the group; exiting", dist.node_rank)
