"""A tensor-parallel group: the ranks' collectives, with no process-global state (two
groups may live in one process, e.g. an engine per test).

Two process groups over one TCP store: `compute` (NCCL on CUDA, gloo on CPU) carries the
all-reduces and all-gathers inside a step and times out after `dist_timeout`; `control`
(gloo, CPU tensors) carries the steps rank 0 sends (within `dist_timeout`), which the
other ranks wait for without a time limit, since a server may stay idle for days. A rank that dies closes its
connections, which fails the others' next collective at once."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=365)
JOIN_TIMEOUT_S = 900.0  # the most starting ranks (processes, then their weights) may take to meet
JOIN_POLL_S = 0.2


class TPGroup:
    """Rank `rank` of `size`. Collectives are blocking and must be entered by every rank
    in the same order.

    Joining: every rank announces itself in the store; rank 0 waits for all of them
    (`JOIN_TIMEOUT_S` at most), asking `failed()` between polls, so a rank that exits
    before it joins fails rank 0's start at once with `failed()`'s message. Collectives
    inside a step time out after `timeout_s`; the start-up ones (after each rank loads
    its weights) after `JOIN_TIMEOUT_S`."""

    def __init__(self, rank: int, size: int, address: tuple[str, int], *, device: torch.device,
                 timeout_s: float, failed: Callable[[], str | None] = lambda: None) -> None:
        self.rank, self.size = rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        join = datetime.timedelta(seconds=max(JOIN_TIMEOUT_S, timeout_s))
        host, port = address
        self.store = dist.TCPStore(host, port, size, rank == 0, timeout=join, wait_for_workers=False)
        self.store.set(f"joined/{rank}", "1")
        if rank == 0:
            self._await_ranks(join.total_seconds(), failed)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, size, join)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", self.store), rank, size, options)
        else:
            self.compute = dist.ProcessGroupGloo(dist.PrefixStore("compute", self.store), rank, size, self.timeout)

    def _await_ranks(self, timeout_s: float, failed: Callable[[], str | None]) -> None:
        keys = [f"joined/{r}" for r in range(self.size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if (message := failed()) is not None:
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if not self.store.check([f"joined/{r}"])]
                raise RuntimeError(f"tensor-parallel ranks {missing} did not join within {timeout_s:.0f} s")
            time.sleep(JOIN_POLL_S)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self.compute.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [R, n] -> [R, size * n]
        """Every rank's `x` side by side along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.compute.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (e.g. KV slots all ranks can hold)."""
        x = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([x], opts).wait()
        return int(x)

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says `ok`."""
        return self.min_int(int(ok)) == 1

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor `x` into every rank's `x` (same shape and dtype). Rank 0 waits
        at most the group's timeout for every rank to take it; the others wait without limit."""
        self.control.broadcast(x, 0, self.timeout if self.rank == 0 else CONTROL_TIMEOUT).wait()
        return x
