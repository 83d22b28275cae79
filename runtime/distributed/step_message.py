"""How rank 0 sends a step to the other ranks: two int64 CPU tensors broadcast over the
control group, a fixed-size header then the body it sizes, and, for a step with images,
a third tensor: their embeddings. Integers only in header and body, no pickle.

header: [command, mode, B, len(input_ids), len(kv_indices), has_lora, has_until, M]
body:   input_ids ++ q_lens ++ kv_lens ++ logits_from ++ lora_slots (when has_lora)
        ++ attend_until (when has_until) ++ the M image rows ++ kv_indices
then, when M > 0: the image embeddings `[M, hidden_size]` in the model's dtype.

Images: rank 0 alone runs the image encoder (`ModelRunner.encode_images`, before the step
is sent) and every rank merges the same embeddings at the same rows, after its
vocab-parallel embedding's all-reduce; so every rank's input embeddings are rank 0's,
bit for bit, and no rank but 0 encodes.

A weight update (`LoadWeights`) is the header [LOAD, 0, 0, n, 0, ...] then the n UTF-8 bytes
of the checkpoint's path, one per integer. A LoRA adapter's load (`LoadLoRA`) is
[LORA_LOAD, 0, m, n, 0, ...] then the n bytes of its name (the first m) and its path; an
unload (`UnloadLoRA`) is [LORA_UNLOAD, 0, 0, n, 0, ...] then the n bytes of its name. A
weight-update group's call (`WeightGroupCall`: join, update, drain, leave) is [WEIGHT_GROUP, 0,
m, n, 0, ...] then the n bytes of its kind (the first m) and its arguments as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import EncodedImages, ForwardStep

STEP, STOP, LOAD, LORA_LOAD, LORA_UNLOAD, WEIGHT_GROUP = 1, 2, 3, 4, 5, 6
MODES = tuple(ForwardMode)  # index <-> mode
HEADER = 8


def send_step(group: TPGroup, step: ForwardStep) -> None:
    """Rank 0: send `step` to every other rank. Its images go as embeddings only
    (`step.encoded`, from `ModelRunner.encode_images`, which rank 0 runs first): pixels are
    never sent, and a model without an image encoder ignores them on every rank."""
    B, lora, until = len(step.q_lens), step.lora_slots or [], step.attend_until or []
    rows = step.encoded.rows if step.encoded is not None else torch.empty(0, dtype=torch.int64)
    header = torch.tensor(
        [STEP, MODES.index(step.mode), B, len(step.input_ids), step.kv_indices.numel(), step.lora_slots is not None,
         step.attend_until is not None, rows.numel()],
        dtype=torch.int64,
    )
    body = torch.cat([
        torch.tensor([*step.input_ids, *step.q_lens, *step.kv_lens, *step.logits_from, *lora, *until],
                     dtype=torch.int64),
        rows.to(torch.int64),
        step.kv_indices.to(torch.int64),
    ])
    group.broadcast(header)
    group.broadcast(body)
    if rows.numel():
        group.broadcast(step.encoded.embeds.to("cpu").contiguous())


@dataclass(frozen=True)
class LoadWeights:
    """Load the checkpoint at `path` (`ModelRunner.update_weights`, every rank agreeing)."""

    path: str


@dataclass(frozen=True)
class LoadLoRA:
    """Load the LoRA adapter at `path` as `name` (`LoRAManager.load`, every rank agreeing)."""

    name: str
    path: str


@dataclass(frozen=True)
class UnloadLoRA:
    """Unload the LoRA adapter `name` (`LoRAManager.unload`)."""

    name: str


@dataclass(frozen=True)
class WeightGroupCall:
    """`kind` ("join", "update", "drain" or "leave") of a weight-update group, with its JSON
    `args` (`weight_sync.WeightGroups`, every rank agreeing)."""

    kind: str
    args: dict[str, Any]


def send_weight_group(group: TPGroup, kind: str, args: dict[str, Any]) -> None:
    """Rank 0: tell every other rank to make weight-update group call `kind` with `args`."""
    _send_text(group, WEIGHT_GROUP, kind, json.dumps(args))


def send_load(group: TPGroup, path: str) -> None:
    """Rank 0: tell every other rank to load the weights at `path`."""
    _send_text(group, LOAD, "", path)


def send_lora(group: TPGroup, name: str, path: str | None) -> None:
    """Rank 0: tell every other rank to load the LoRA adapter at `path` as `name`, or to
    unload `name` when `path` is None."""
    if path is None:
        _send_text(group, LORA_UNLOAD, "", name)
    else:
        _send_text(group, LORA_LOAD, name, path)


def send_stop(group: TPGroup) -> None:
    """Rank 0: tell every other rank to leave its loop."""
    group.broadcast(_header(STOP, 0, 0))


def _send_text(group: TPGroup, command: int, first: str, second: str) -> None:
    head, data = list(first.encode()), list((first + second).encode())
    group.broadcast(_header(command, len(head), len(data)))
    group.broadcast(torch.tensor(data, dtype=torch.int64))


def _header(command: int, m: int, n: int) -> torch.Tensor:
    return torch.tensor([command, 0, m, n] + [0] * (HEADER - 4), dtype=torch.int64)


def receive(group: TPGroup, hidden_size: int, dtype: torch.dtype
            ) -> ForwardStep | LoadWeights | LoadLoRA | UnloadLoRA | WeightGroupCall | None:
    """Ranks > 0: the next step, weight update, LoRA adapter change or weight-update group
    call, or None when rank 0
    says stop; a step's image embeddings arrive as `[M, hidden_size]` of `dtype` (the
    model's: rank 0's encoder computes them in it). Blocks without a time limit; raises if
    rank 0's connection is lost."""
    header = group.broadcast(torch.zeros(HEADER, dtype=torch.int64))
    command, mode, B, n_ids, n_kv, has_lora, has_until, n_rows = header.tolist()
    if command == STOP:
        return None
    if command in (LOAD, LORA_LOAD, LORA_UNLOAD, WEIGHT_GROUP):
        data = bytes(group.broadcast(torch.empty(n_ids, dtype=torch.int64)).tolist())
        first, second = data[:B].decode(), data[B:].decode()
        if command == WEIGHT_GROUP:
            return WeightGroupCall(first, json.loads(second))
        if command == LOAD:
            return LoadWeights(second)
        return LoadLoRA(first, second) if command == LORA_LOAD else UnloadLoRA(second)
    if command != STEP:
        raise ValueError(f"unknown command {command} from rank 0")
    n_lora, n_until = (B if has_lora else 0), (n_ids if has_until else 0)
    n_ints = n_ids + 3 * B + n_lora + n_until
    body = group.broadcast(torch.empty(n_ints + n_rows + n_kv, dtype=torch.int64))
    ints = body[:n_ints].tolist()
    encoded = None
    if n_rows:
        embeds = group.broadcast(torch.empty(n_rows, hidden_size, dtype=dtype))
        encoded = EncodedImages(body[n_ints : n_ints + n_rows], embeds)
    lora_end = n_ids + 3 * B + n_lora
    return ForwardStep(
        mode=MODES[mode],
        input_ids=ints[:n_ids],
        q_lens=ints[n_ids : n_ids + B],
        kv_lens=ints[n_ids + B : n_ids + 2 * B],
        logits_from=ints[n_ids + 2 * B : n_ids + 3 * B],
        lora_slots=ints[n_ids + 3 * B : lora_end] if has_lora else None,
        kv_indices=body[n_ints + n_rows :],
        attend_until=ints[lora_end:] if has_until else None,
        encoded=encoded,
    )
