"""The registry of quantized checkpoint formats, keyed by config.json's
`quantization_config.quant_method`, and the online schemes (their names, torch-free:
`quantization.online_schemes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sprig.runtime.quantization.formats.awq import AWQFormat
from sprig.runtime.quantization.formats.base import WeightFormat
from sprig.runtime.quantization.formats.compressed_tensors import CompressedTensorsFormat
from sprig.runtime.quantization.formats.fp8 import Fp8Format
from sprig.runtime.quantization.formats.gptq import GPTQFormat
from sprig.runtime.quantization.formats.online import OnlineFormat

CHECKPOINT_FORMATS: dict[str, Callable[[dict[str, Any]], WeightFormat]] = {
    "gptq": GPTQFormat.from_config,
    "awq": AWQFormat.from_config,
    "compressed-tensors": CompressedTensorsFormat.from_config,
    "fp8": Fp8Format.from_config,
}


def checkpoint_format(quantization_config: dict[str, Any]) -> WeightFormat:
    """The format a checkpoint's `quantization_config` describes; ValueError naming the
    method (or the unsupported option) otherwise."""
    method = quantization_config.get("quant_method")
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"quantization method {method!r} is not supported; supported: {', '.join(CHECKPOINT_FORMATS)}"
        )
    return CHECKPOINT_FORMATS[method](quantization_config)


__all__ = [
    "CHECKPOINT_FORMATS",
    "OnlineFormat",
    "WeightFormat",
    "checkpoint_format",
]
