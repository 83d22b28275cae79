"""What a weight update accepts and answers, shared by the offline `Engine` and the
server's weight routes (SGLang's API): the load formats taken, the message of a success,
how much `get_weights_by_name` reads back, and the requests of an update from a trainer's
process group (`GroupSpec`, `BroadcastPlan`: checked here, before anything is joined or
received). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOAD_FORMATS = ("auto", "safetensors")  # or None: safetensors is the one format read
MAX_WEIGHT_VALUES = 1 << 20  # most values `get_weights_by_name` reads back (about 20 MB of JSON)


def check_load_format(load_format: str | None) -> None:
    """ValueError naming `load_format` unless it is None or one of `LOAD_FORMATS`."""
    if load_format is not None and load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)} or null (checkpoints are read from "
                         f"safetensors files), got {load_format!r}")


def check_truncate_size(truncate_size: int) -> None:
    """ValueError naming `truncate_size` unless it is at least one row."""
    if truncate_size < 1:
        raise ValueError(f"truncate_size must be >= 1 row, got {truncate_size}")


def check_weight_values(rows: int, values: int) -> None:
    """ValueError naming `truncate_size` when its `rows` hold more than `MAX_WEIGHT_VALUES`."""
    if values > MAX_WEIGHT_VALUES:
        raise ValueError(f"truncate_size: {rows} rows hold {values} values, more than the {MAX_WEIGHT_VALUES} read "
                         "back at once; ask for fewer rows")


def update_message(weight_version: str | None, tensors: int | None = None) -> str:
    """SGLang's message for an update that succeeded (with how many `tensors` were copied,
    for an update from tensors)."""
    message = "Succeeded to update model weights."
    if tensors is not None:
        message = f"Succeeded to update model weights ({tensors} tensors)."
    return message if weight_version is None else f"{message} Weight version updated to {weight_version}."


class WeightUpdateError(ValueError):
    """New weights were not loaded; the previous ones are in place."""


DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name
GROUP_BACKENDS = ("gloo", "nccl")
BROADCAST_DTYPES = ("float32", "float16", "bfloat16")  # what a trainer may broadcast ("torch." prefix taken too)
MAX_BROADCAST_TENSORS = 65536  # tensors one update from a group names at most
MAX_NAME_CHARS = 1024


@dataclass(frozen=True)
class GroupSpec:
    """A weight-update group to join (SGLang's `/init_weights_update_group`): the trainer is
    rank 0 and hosts the rendezvous at `master_address:master_port`; this engine's
    tensor-parallel rank r joins as `rank_offset + r` of `world_size`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if not self.master_address or len(self.master_address) > 255:
            raise ValueError("master_address must be a host name or address of 1 to 255 characters")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {self.rank_offset}")
        if self.world_size <= self.rank_offset:
            raise ValueError(f"world_size ({self.world_size}) must exceed rank_offset ({self.rank_offset})")
        check_group_name(self.group_name)
        if self.backend not in GROUP_BACKENDS:
            raise ValueError(f"backend must be one of {list(GROUP_BACKENDS)}, got {self.backend!r}")

    def check_ranks(self, tp_size: int) -> None:
        """ValueError naming `world_size` unless this engine's `tp_size` ranks fit from `rank_offset`."""
        if self.rank_offset + tp_size > self.world_size:
            raise ValueError(f"world_size {self.world_size} has no room for this engine's {tp_size} rank(s) from "
                             f"rank_offset {self.rank_offset}")


@dataclass(frozen=True)
class BroadcastPlan:
    """The tensors a trainer broadcasts over group `group_name`, in order (SGLang's
    `/update_weights_from_distributed`): checkpoint `names`, `dtypes` (float dtype names)
    and `shapes`, one each per tensor; at most `MAX_BROADCAST_TENSORS`."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP

    def __post_init__(self) -> None:
        n = len(self.names)
        if not 0 < n <= MAX_BROADCAST_TENSORS:
            raise ValueError(f"names must list 1 to {MAX_BROADCAST_TENSORS} tensors, got {n}")
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor: {n}, {len(self.dtypes)} "
                             f"and {len(self.shapes)}")
        for name, dtype, shape in zip(self.names, self.dtypes, self.shapes, strict=True):
            if not name or len(name) > MAX_NAME_CHARS:
                raise ValueError(f"names: each must be 1 to {MAX_NAME_CHARS} characters")
            if dtype_name(dtype) not in BROADCAST_DTYPES:
                raise ValueError(f"dtypes: {name!r} has dtype {dtype!r}; a broadcast tensor is one of "
                                 f"{list(BROADCAST_DTYPES)}")
            if any(d < 0 for d in shape):
                raise ValueError(f"shapes: {name!r} has shape {list(shape)}, with a negative size")
        check_group_name(self.group_name)

    @classmethod
    def of(cls, args: dict[str, Any]) -> BroadcastPlan:
        """From JSON-like `args` (lists for tuples)."""
        return cls(tuple(args["names"]), tuple(args["dtypes"]), tuple(tuple(s) for s in args["shapes"]),
                   args.get("group_name", DEFAULT_GROUP))

    def as_args(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "group_name": self.group_name}


def dtype_name(dtype: str) -> str:
    """`dtype` without torch's "torch." prefix (trainers send `str(tensor.dtype)`)."""
    return dtype.removeprefix("torch.")


def check_group_name(name: str) -> None:
    """ValueError naming `group_name` unless it is 1 to 256 characters."""
    if not name or len(name) > 256:
        raise ValueError("group_name must be 1 to 256 characters")
