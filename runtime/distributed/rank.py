"""A tensor-parallel rank other than 0: its part of the model, running the steps rank 0
sends until rank 0 says stop. Started as `python -m sprig.runtime.distributed.rank SPEC`,
SPEC a JSON object (`rank_spec`): nothing but JSON crosses into the process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from sprig.runtime.distributed.config import DistConfig
from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.step_message import (
    LoadLoRA,
    LoadWeights,
    UnloadLoRA,
    WeightGroupCall,
    receive,
)
from sprig.runtime.model_runner import ModelRunner, WeightUpdateError
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.weight_update import BroadcastPlan, GroupSpec

log = logging.getLogger("sprig.tp")


def _on_cuda(config: RunnerConfig) -> bool:
    return torch.cuda.is_available() if config.device == "auto" else torch.device(config.device).type == "cuda"


def check_devices(config: RunnerConfig, dist: DistConfig) -> None:
    """ValueError, before any rank starts, if this node's ranks would run on CUDA with fewer
    GPUs than ranks (each takes its own: `rank_config`)."""
    if _on_cuda(config) and torch.cuda.device_count() < dist.per_node:
        raise ValueError(
            f"--tp-size {dist.tp_size} over {dist.nnodes} node(s) runs {dist.per_node} tensor-parallel ranks on this "
            f"node, one GPU each, and it has {torch.cuda.device_count()}: use more nodes (--nnodes), a smaller "
            "--tp-size, or --device cpu"
        )


def rank_config(config: RunnerConfig, dist: DistConfig, rank: int) -> RunnerConfig:
    """Rank `rank`'s runner settings: on CUDA the node's `rank % per_node`-th GPU; on CPU,
    unless `cpu_threads` is set, the node's cores shared among its ranks."""
    if _on_cuda(config):
        return replace(config, device=f"cuda:{rank % dist.per_node}")
    if config.cpu_threads is None:
        return replace(config, device="cpu", cpu_threads=max(1, (os.cpu_count() or 1) // dist.per_node))
    return replace(config, device="cpu")


def connect(config: RunnerConfig, dist: DistConfig, rank: int, address: tuple[str, int],
            failed: Callable[[], str | None] = lambda: None) -> TPGroup:
    """Join the group as `rank` (see `TPGroup` for the waits and `failed`)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return TPGroup(rank, dist.tp_size, address, device=device, timeout_s=dist.dist_timeout, failed=failed)


def run_rank(config: RunnerConfig, dist: DistConfig, rank: int, address: tuple[str, int]) -> None:
    """Serve rank `rank` (> 0) until rank 0 sends stop; raises if the group fails."""
    config = rank_config(config, dist, rank)
    group = connect(config, dist, rank, address)
    runner = ModelRunner(config, tp=group)
    log.info("tensor-parallel rank %d of %d ready on %s", rank, dist.tp_size, runner.device)
    while True:
        try:
            step = receive(group, runner.model_config.hidden_size, runner.dtype)
        except RuntimeError as e:
            raise RuntimeError(f"lost rank 0 while waiting for a step ({e})") from None
        if step is None:
            break
        if isinstance(step, LoadWeights):
            with contextlib.suppress(WeightUpdateError):  # rank 0 reports it; the old weights stay
                runner.update_weights(step.path, agree=group.all_agree)
            continue
        if isinstance(step, LoadLoRA):
            try:
                runner.lora.load(step.name, step.path)
            except ValueError as e:  # rank 0 reports it; no rank took the adapter
                log.warning("tensor-parallel rank %d: LoRA adapter %r not loaded: %s", rank, step.name, e)
            continue
        if isinstance(step, UnloadLoRA):
            runner.lora.unload(step.name)
            continue
        if isinstance(step, WeightGroupCall):
            _weight_group_call(runner, step, rank)
            continue
        runner.forward(step)
    runner.close()
    log.info("tensor-parallel rank %d: rank 0 sent stop", rank)


def _weight_group_call(runner: ModelRunner, call: WeightGroupCall, rank: int) -> None:
    """Make the weight-update group call rank 0 announced (`WeightGroups`), agreeing with
    the other ranks; a failure is rank 0's to report."""
    groups = runner.weight_groups
    try:
        if call.kind == "join":
            groups.join(GroupSpec(**call.args))
        elif call.kind == "update":
            groups.update(BroadcastPlan.of(call.args))
        elif call.kind == "drain":
            groups.drain(BroadcastPlan.of(call.args))
        else:
            groups.leave(call.args["group_name"])
    except ValueError as e:
        log.warning("tensor-parallel rank %d: weight-update group call %r failed: %s", rank, call.kind, e)


def rank_spec(config: RunnerConfig, dist: DistConfig, rank: int, address: tuple[str, int],
              *, parent: int | None, log_level: str) -> str:
    return json.dumps({
        "runner": {**dataclasses.asdict(config), "model_path": str(config.model_path)},
        "dist": dataclasses.asdict(dist),
        "rank": rank,
        "address": list(address),
        "parent": parent,
        "log_level": log_level,
    })


def spawn_rank(config: RunnerConfig, dist: DistConfig, rank: int, address: tuple[str, int]) -> subprocess.Popen:
    """Start rank `rank` as a child of this process (it exits when this process does)."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    spec = rank_spec(config, dist, rank, address, parent=os.getpid(), log_level=level)
    return subprocess.Popen([sys.executable, "-m", "sprig.runtime.distributed.rank", spec])


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(argv[0])
    rank = spec["rank"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group; rank 0 decides
    if spec["parent"] is not None:
        from sprig.runtime.processes import die_with_parent

        die_with_parent(spec["parent"])
    logging.basicConfig(level=spec["log_level"].upper(),
                        format=f"[%(asctime)s tp-rank-{rank}] %(levelname)s %(name)s: %(message)s")
    try:
        run_rank(RunnerConfig(**spec["runner"]), DistConfig(**spec["dist"]), rank, tuple(spec["address"]))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    from sprig.runtime.processes import exit_now

    exit_now(main(sys.argv[1:]))
