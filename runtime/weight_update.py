"""What a weight update accepts and answers, shared by `Engine.update_weights_from_disk`
and the server's `/update_weights_from_disk` (SGLang's API): the load formats taken and
the message of a success. Torch-free."""

from __future__ import annotations

LOAD_FORMATS = ("auto", "safetensors")  # or None: safetensors is the one format read


def check_load_format(load_format: str | None) -> None:
    """ValueError naming `load_format` unless it is None or one of `LOAD_FORMATS`."""
    if load_format is not None and load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)} or null (checkpoints are read from "
                         f"safetensors files), got {load_format!r}")


def update_message(weight_version: str | None, tensors: int | None = None) -> str:
    """SGLang's message for an update that succeeded (with how many `tensors` were copied,
    for an update from tensors)."""
    message = "Succeeded to update model weights."
    if tensors is not None:
        message = f"Succeeded to update model weights ({tensors} tensors)."
    return message if weight_version is None else f"{message} Weight version updated to {weight_version}."
