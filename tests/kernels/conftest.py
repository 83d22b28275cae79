"""Kernel tests run the Triton kernels against their torch references.

Without CUDA the kernels run in Triton's CPU interpreter. `TRITON_INTERPRET` is read when
`@triton.jit` decorates a function, so tests/conftest.py sets it before anything imports
triton; the `device` fixture fails loudly if that did not happen.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _interpreter_ready() -> bool:
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


@pytest.fixture
def device() -> str:
    """Where the Triton side of a comparison runs: CUDA when present, else the interpreter."""
    if HAS_CUDA:
        return "cuda"
    assert _interpreter_ready(), "triton was imported before TRITON_INTERPRET=1 was set"
    return "cpu"


@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the public dispatchers take the Triton path even for CPU tensors."""
    monkeypatch.setenv("SPRIG_FORCE_TRITON", "1")


@pytest.fixture
def tol() -> dict[torch.dtype, dict[str, float]]:
    """assert_close tolerances per dtype for Triton-vs-reference comparisons.

    float32 differs only by summation order; the CPU interpreter rounds float32 -> bfloat16
    toward zero (compiled kernels round to nearest), hence the loose bf16 bound.
    """
    return {
        torch.float32: {"atol": 2e-5, "rtol": 1e-5},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.bfloat16: {"atol": 4e-2, "rtol": 3e-2},
    }
