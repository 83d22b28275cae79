"""Choosing between a Triton kernel and its torch reference.

Triton runs when every tensor argument is on CUDA, or when `SPRIG_FORCE_TRITON=1`
(used by the tests together with `TRITON_INTERPRET=1`, which must be set before
`triton` decorates the kernels, i.e. before any `sprig.kernels` module is imported);
never where Triton is not installed.
"""

from __future__ import annotations

import os

import torch

from ._triton import HAS_TRITON


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when the Triton path should run for these tensors; `RuntimeError` if
    `SPRIG_FORCE_TRITON=1` asks for Triton where it is not installed."""
    if os.environ.get("SPRIG_FORCE_TRITON", "0") == "1":
        if not HAS_TRITON:
            raise RuntimeError("SPRIG_FORCE_TRITON=1, but Triton is not installed")
        return True
    return HAS_TRITON and all(t.is_cuda for t in tensors if t is not None)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast bf16 `tl.dot` operands to float32.

    Triton's CPU interpreter (TRITON_INTERPRET=1, 3.x) multiplies bf16 operands as their raw
    integer bits; compiled kernels never need this.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
