"""What a weight update accepts and answers, shared by `Engine.update_weights_from_disk`
and the server's `/update_weights_from_disk` (SGLang's API): the load formats taken, the
message of a success, and how much `get_weights_by_name` reads back. Torch-free."""

from __future__ import annotations

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
