"""How rank 0 sends a step to the other ranks: two int64 CPU tensors broadcast over the
control group, a fixed-size header then the body it sizes. Integers only, no pickle.

header: [command, mode, B, len(input_ids), len(kv_indices)]
body:   input_ids ++ q_lens ++ kv_lens ++ logits_from ++ kv_indices

A weight update (`LoadWeights`) is the header [LOAD, 0, 0, n, 0] then the n UTF-8 bytes
of the checkpoint's path, one per integer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep

STEP, STOP, LOAD = 1, 2, 3
MODES = tuple(ForwardMode)  # index <-> mode
HEADER = 5


def send_step(group: TPGroup, step: ForwardStep) -> None:
    """Rank 0: send `step` to every other rank."""
    B = len(step.q_lens)
    header = torch.tensor(
        [STEP, MODES.index(step.mode), B, len(step.input_ids), step.kv_indices.numel()], dtype=torch.int64
    )
    body = torch.cat([
        torch.tensor([*step.input_ids, *step.q_lens, *step.kv_lens, *step.logits_from], dtype=torch.int64),
        step.kv_indices.to(torch.int64),
    ])
    group.broadcast(header)
    group.broadcast(body)


@dataclass(frozen=True)
class LoadWeights:
    """Load the checkpoint at `path` (`ModelRunner.update_weights`, every rank agreeing)."""

    path: str


def send_load(group: TPGroup, path: str) -> None:
    """Rank 0: tell every other rank to load the weights at `path`."""
    data = list(path.encode())
    group.broadcast(torch.tensor([LOAD, 0, 0, len(data), 0], dtype=torch.int64))
    group.broadcast(torch.tensor(data, dtype=torch.int64))


def send_stop(group: TPGroup) -> None:
    """Rank 0: tell every other rank to leave its loop."""
    group.broadcast(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))


def receive(group: TPGroup) -> ForwardStep | LoadWeights | None:
    """Ranks > 0: the next step or weight update, or None when rank 0 says stop. Blocks
    without a time limit; raises if rank 0's connection is lost."""
    header = group.broadcast(torch.zeros(HEADER, dtype=torch.int64))
    command, mode, B, n_ids, n_kv = header.tolist()
    if command == STOP:
        return None
    if command == LOAD:
        return LoadWeights(bytes(group.broadcast(torch.empty(n_ids, dtype=torch.int64)).tolist()).decode())
    if command != STEP:
        raise ValueError(f"unknown command {command} from rank 0")
    body = group.broadcast(torch.empty(n_ids + 3 * B + n_kv, dtype=torch.int64))
    ints = body[: n_ids + 3 * B].tolist()
    return ForwardStep(
        mode=MODES[mode],
        input_ids=ints[:n_ids],
        q_lens=ints[n_ids : n_ids + B],
        kv_lens=ints[n_ids + B : n_ids + 2 * B],
        logits_from=ints[n_ids + 2 * B :],
        kv_indices=body[n_ids + 3 * B :],
    )
