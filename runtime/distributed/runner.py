"""Rank 0 of a tensor-parallel group, seen by the scheduler as one model runner."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import torch

from sprig.runtime.distributed.config import DistConfig
from sprig.runtime.distributed.rank import check_devices, connect, rank_config, spawn_rank
from sprig.runtime.distributed.shard import ShardPlan
from sprig.runtime.distributed.step_message import send_load, send_step, send_stop
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner, WeightUpdateError
from sprig.runtime.processes import free_port
from sprig.runtime.runner_config import RunnerConfig

log = logging.getLogger("sprig.tp")
RANK_EXIT_WAIT_S = 2.0  # after a failed step: how long to wait for a rank's exit code, to name it
STOP_WAIT_S = 10.0


class TPRunner:
    """Starts this node's other ranks (`python -m sprig.runtime.distributed.rank`), joins
    the group as rank 0 and runs its part of the model; `forward(step)` sends the step to
    every rank first, its images encoded by rank 0 alone and sent as embeddings
    (`step_message`). Other attributes are rank 0's `ModelRunner`'s (`model_config`,
    `num_slots`, `generator`, ...): the logits it returns are the whole vocabulary's, and
    what reads or writes weights outside a step (`update_weights_from_tensors`,
    `get_weights_by_name`) refuses, since rank 0 holds only its part.

    A rank that exits while the runner is open, or a step whose collectives fail, leaves
    the group unusable: `failure` then names what happened (the rank, where it is this
    node's), every later `forward` raises `RuntimeError` with it, and `on_failure(message)`
    is called once (a server exits there)."""

    def __init__(self, config: RunnerConfig, dist: DistConfig,
                 on_failure: Callable[[str], None] | None = None, *, draft_model_path: str | None = None) -> None:
        """`draft_model_path`: a draft model will run whole beside rank 0 (speculative
        decoding); rank 0's pool, and so every rank's, leaves room for it."""
        if dist.node_rank != 0:
            raise ValueError("rank 0 runs on node 0; other nodes run `sprig serve --node-rank N` (no scheduler)")
        check_splittable(config, dist)
        check_devices(config, dist)
        self.dist, self.on_failure = dist, on_failure
        self.failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        address = dist.address() if dist.dist_init_addr else ("127.0.0.1", free_port("127.0.0.1"))
        self.ranks: dict[int, subprocess.Popen] = {}
        try:
            for rank in dist.node_ranks()[1:]:
                self.ranks[rank] = spawn_rank(config, dist, rank, address)
                threading.Thread(target=self._watch, args=(rank,), daemon=True, name=f"tp-watch-{rank}").start()
            config = rank_config(config, dist, 0)
            self.group = connect(config, dist, 0, address, failed=lambda: self.failure)
            self.runner = ModelRunner(config, tp=self.group, draft_model_path=draft_model_path)
        except BaseException as e:
            self._closing = True
            self._stop_ranks(0.0)
            if self.failure is not None and isinstance(e, RuntimeError):  # a rank exited first: name it
                raise RuntimeError(self.failure) from e
            raise

    def __getattr__(self, name: str) -> Any:
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def forward(self, step: ForwardStep) -> torch.Tensor:
        """Logits `[R, vocab]` of `step` (see `ModelRunner.forward`), computed by every rank."""
        return self._on_every_rank(step, self.runner.forward)

    def forward_with_hidden(self, step: ForwardStep) -> tuple[torch.Tensor, torch.Tensor]:
        """`ModelRunner.forward_with_hidden` of `step`: the other ranks run `forward`, whose
        eager path makes the same collectives; rank 0's hidden states are whole (every
        layer ends in an all-reduce)."""
        return self._on_every_rank(step, self.runner.forward_with_hidden)

    def update_weights(self, path: str) -> None:
        """`ModelRunner.update_weights` on every rank: all ranks take the new weights, or
        all keep the old (`WeightUpdateError`). A rank's failure to restore them fails the
        group (`failure`)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        try:
            send_load(self.group, str(path))
            self.runner.update_weights(path, agree=self.group.all_agree)
        except WeightUpdateError:
            raise
        except Exception as e:
            raise RuntimeError(self._fail(self._dead_rank(RANK_EXIT_WAIT_S) or f"the tensor-parallel group failed: {e}")) from e

    def _on_every_rank(self, step: ForwardStep, run: Callable[[ForwardStep], Any]) -> Any:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        longest = max(step.kv_lens)  # checked here as well: a step every rank refuses is never sent
        if longest > self.runner.model_config.context_len:
            raise ValueError(
                f"a context of {longest} tokens exceeds the model's context_len {self.runner.model_config.context_len}"
            )
        step = self.runner.encode_images(step)  # before it is sent: a failure here leaves the group in step
        try:
            send_step(self.group, step)
            return run(step)
        except Exception as e:
            raise RuntimeError(self._fail(self._dead_rank(RANK_EXIT_WAIT_S) or f"the tensor-parallel group failed: {e}")) from e

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (killing any that do not)."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None:
            with contextlib.suppress(Exception):
                send_stop(self.group)
        self._stop_ranks(STOP_WAIT_S if self.failure is None else 0.0)

    # ------------------------------------------------------------------ internals
    def _watch(self, rank: int) -> None:
        code = self.ranks[rank].wait()
        if not self._closing:
            self._fail(self._describe(rank, code))

    def _describe(self, rank: int, code: int) -> str:
        return (f"tensor-parallel rank {rank} (pid {self.ranks[rank].pid}) exited with code {code}; "
                "the model cannot run without it")

    def _dead_rank(self, wait_s: float) -> str | None:
        for rank, proc in self.ranks.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self._describe(rank, proc.wait(wait_s))
        return None

    def _fail(self, message: str) -> str:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = message
        if first:
            log.error("%s", message)
            if self.on_failure is not None:
                self.on_failure(message)
        return self.failure

    def _stop_ranks(self, wait_s: float) -> None:
        for proc in self.ranks.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait_s)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_splittable(config: RunnerConfig, dist: DistConfig) -> None:
    """ValueError, before any rank starts, if the model cannot be split over `tp_size` ranks."""
    model = ModelConfig.from_pretrained(config.model_path, context_length=config.context_length)
    ShardPlan(model, 0, dist.tp_size)


def make_runner(config: RunnerConfig, dist: DistConfig, on_failure: Callable[[str], None] | None = None, *,
                draft_model_path: str | None = None) -> ModelRunner | TPRunner:
    """One process's runner for `tp_size` 1, else rank 0 of a tensor-parallel group; its
    pool leaves room for a draft model at `draft_model_path` (see `ModelRunner`)."""
    if dist.tp_size == 1:
        return ModelRunner(config, draft_model_path=draft_model_path)
    return TPRunner(config, dist, on_failure, draft_model_path=draft_model_path)
