"""kernels/ holds no state across calls: no memoized functions and no module-level
mutable containers. State that a fast path keeps between steps lives in the attention
backend that owns it (sprig.runtime.attention)."""

from __future__ import annotations

import importlib
import pkgutil

import sprig.kernels


def test_no_kernel_module_keeps_state() -> None:
    for info in pkgutil.iter_modules(sprig.kernels.__path__):
        module = importlib.import_module(f"sprig.kernels.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            assert not hasattr(value, "cache_info"), f"{info.name}.{name} memoizes calls"
            assert not isinstance(value, (dict, list, set, bytearray)), f"{info.name}.{name} is mutable module state"
