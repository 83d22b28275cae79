"""`triton` and `triton.language`, or stand-ins where Triton is not installed (it ships
Linux wheels only). With the stand-ins the kernel modules still define their kernels, so
`sprig.kernels` imports and every torch reference (the CPU path) runs; launching a
kernel raises `RuntimeError`. `HAS_TRITON` says which it is.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _Absent:
        """Any name under `triton`: attributes and calls (decorators, `tl.constexpr`
        annotations, dtypes) give more stand-ins; launching (`kernel[grid]`) raises."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, attr: str) -> _Absent:
            return _Absent(f"{self._name}.{attr}")

        def __call__(self, *args: Any, **kwargs: Any) -> _Absent:
            return _Absent(f"{self._name}(...)")

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"{self._name}: Triton is not installed (pip install triton, on Linux); "
                               "on CPU the torch references run instead")

    triton = _Absent("triton")
    tl = _Absent("triton.language")

__all__ = ["HAS_TRITON", "tl", "triton"]
