"""Shared fixtures: tiny real checkpoints built offline, and the `gpu` marker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n N`: the workers share the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from server_helpers import Server, running_server

from sprig.runtime.tiny_checkpoint import ARCHITECTURES, build_tiny_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    minutes = config.getoption("--fuzz-minutes")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "fuzz" in item.keywords and minutes:  # a long fuzz run outlasts the default timeout
            item.add_marker(pytest.mark.timeout(minutes * 60 + 900))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture, keyed by arch name."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: build_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def server(tiny_llama: Path) -> Iterator[Server]:
    """One real server on the tiny llama for the whole session (starting one costs
    seconds: three processes each load torch and transformers), started on first use.
    Tests that break or stop a server start their own."""
    with running_server(tiny_llama) as s:
        yield s


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-minutes", type=float, default=float(os.environ.get("SPRIG_FUZZ_MINUTES", "0")),
        help="run the engine's differential fuzzer this long (default: CI's bounded budget; "
        "or set SPRIG_FUZZ_MINUTES)",
    )
    parser.addoption(
        "--fuzz-seed", type=int, default=int(os.environ.get("SPRIG_FUZZ_SEED", "0")),
        help="the fuzzer's first workload seed (a failure names the seed that reproduces it)",
    )
