"""Shared fixtures: tiny real checkpoints built offline, and the `gpu` marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sprig.runtime.tiny_checkpoint import ARCHITECTURES, build_tiny_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture, keyed by arch name."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: build_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]
