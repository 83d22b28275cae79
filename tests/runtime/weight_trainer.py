"""A stand-in RL trainer for the weight-sync tests, run in its own process (spawn): it
holds a checkpoint's tensors, joins a weight-update group as rank 0 the way SGLang's and
the RL frameworks' `init_custom_process_group` does (torch's own group creation over a
TCP store it hosts, under the group's name), and broadcasts the tensors it is told to,
in order. Commands arrive over a pipe: ("join", (port, world_size, group_name)),
("send", names), ("send_zeros", [(shape, dtype), ...]) (tensors of a trainer whose names
or shapes the model lacks), ("leave", None), ("stop", None); each is answered with "ok" or
the error's text."""

from __future__ import annotations

import datetime
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

TIMEOUT = datetime.timedelta(seconds=60)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= load_file(str(f))
    return tensors


def _join(port: int, world_size: int, group_name: str) -> dist.ProcessGroup:
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=TIMEOUT))
    group, _ = _new_process_group_helper(world_size, 0, [], Backend("gloo"), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=TIMEOUT)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # so that destroy_process_group takes it
    return group


def trainer_main(conn: Connection, checkpoint: str) -> None:
    tensors = checkpoint_tensors(Path(checkpoint))
    group = None
    while True:
        command, arg = conn.recv()
        try:
            if command == "join":
                group = _join(*arg)
            elif command == "send":
                for name in arg:
                    group.broadcast(tensors[name].contiguous(), 0).wait()
            elif command == "send_zeros":
                for shape, dtype in arg:
                    group.broadcast(torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch."))), 0).wait()
            elif command == "leave":
                dist.destroy_process_group(group)
                group = None
            else:
                conn.send("ok")
                return
        except Exception as e:
            conn.send(f"{type(e).__name__}: {e}")
            continue
        conn.send("ok")
