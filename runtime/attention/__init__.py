"""The attention-backend registry: name -> backend class, imported only when chosen
(so that importing this package imports neither torch nor Triton: `RunnerConfig` and the
CLI read the names).

Every backend class is constructed as `cls(model_config: ModelConfig, kv_cache: KVCache)`
and implements `AttentionBackend` (see base.py). `reference` is the plain one the others
are checked against (`make_backend(..., shadow=True)`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sprig.radix.kv_cache import KVCache
    from sprig.runtime.attention.base import AttentionBackend
    from sprig.runtime.model_config import ModelConfig

# name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "sprig.runtime.attention.cpu:TorchAttentionBackend",
    "triton": "sprig.runtime.attention.triton_backend:TritonAttentionBackend",
    "reference": "sprig.runtime.attention.reference:ReferenceAttentionBackend",
}
# the backend "auto" picks, by device type
DEFAULT_BACKENDS: dict[str, str] = {"cuda": "triton", "cpu": "torch"}


def backend_class(name: str) -> type[AttentionBackend]:
    """Import and return the backend class registered as `name`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )
    module, _, cls = ATTENTION_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, model_config: ModelConfig, kv_cache: KVCache, *, shadow: bool = False) -> AttentionBackend:
    """The backend registered as `name`; with `shadow`, wrapped so that every layer's output
    is checked against the reference backend's (`shadow.ShadowAttention`)."""
    backend = backend_class(name)(model_config, kv_cache)
    if not shadow:
        return backend
    from sprig.runtime.attention.shadow import ShadowAttention

    return ShadowAttention(backend, backend_class("reference")(model_config, kv_cache))


def default_backend(device_type: str) -> str:
    """The backend `attention_backend="auto"` means on a device of this type."""
    if device_type not in DEFAULT_BACKENDS:
        raise ValueError(f"no default attention backend for device type {device_type!r}")
    return DEFAULT_BACKENDS[device_type]


__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_BACKENDS",
    "backend_class",
    "default_backend",
    "make_backend",
]
