"""Shared fixtures: tiny real checkpoints built offline, and the `gpu` marker."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n N`: the workers share the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from server_helpers import Server, running_server

from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.tiny_checkpoint import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    PHI3_ARCHITECTURES,
    build_tiny_checkpoint,
    build_tokenizer,
)

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# without it every server a test starts compiles sprig in each of its processes, and every
# worker rewrites every test module's asserts afresh (about 1 s a process on 2 cores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The files that take longest, longest first (seconds a worker spent on each in a
# `pytest -n auto --durations=0` run on 2 cores). Under xdist each file runs whole on one
# worker, in collection order (`--no-loadscope-reorder`): these first, so that no worker
# ends the run alone on a long one.
SLOWEST_FILES = (
    "runtime/test_gateway.py",  # 70
    "runtime/test_tp_engine.py",  # 66
    "runtime/test_engine_fuzz.py",  # 61
    "runtime/test_speculative_engine.py",  # 60
    "runtime/test_speculative_server.py",  # 56
    "runtime/test_server_schemathesis.py",  # 49
    "lang/test_sglang_frontend.py",  # 41 (skipped without .venv-sglang)
    "runtime/test_server_reasoning.py",  # 39
    "runtime/test_tp_server.py",  # 33
    "runtime/test_speculative_draft_model.py",  # 29
    "runtime/test_server_liveness.py",  # 28
    "runtime/test_quant_server.py",  # 27
    "runtime/test_server_langchain.py",  # 26
    "runtime/test_server_weight_updates.py",  # 25
    "runtime/test_server_messages.py",  # 23
    "kernels/test_sliding_window.py",  # 23
    "runtime/test_server_agent_clients.py",  # 22 (skipped without .venv-clients)
    "runtime/test_priority_scheduling.py",  # 19
    "kernels/test_image_blocks.py",  # 19
    "test_examples.py",  # 19
    "runtime/test_batch_invariance.py",  # 19
    "runtime/test_server_mistral_reasoning.py",  # 18
    "runtime/test_server_flags.py",  # 18
    "test_import_graph.py",  # 17
    "runtime/test_server_images.py",  # 16
    "runtime/test_weights_from_distributed.py",  # 16
    "runtime/test_quant_parity.py",  # 16
    "runtime/test_server_hostile.py",  # 16
    "runtime/test_weight_update_engine.py",  # 16
    "kernels/test_attention_sinks.py",  # 16
    "runtime/test_kv_int8.py",  # 15
)


def _slowest_first(items: list[pytest.Item]) -> None:
    """Order `items` by file: `SLOWEST_FILES` in their order, then the rest as collected."""
    tests = Path(__file__).parent
    missing = [name for name in SLOWEST_FILES if not (tests / name).is_file()]
    assert not missing, f"SLOWEST_FILES names files that are gone: {missing}"
    rank = {tests / name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slowest_first(items)
    minutes = config.getoption("--fuzz-minutes")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "fuzz" in item.keywords and minutes:  # a long fuzz run outlasts the default timeout
            item.add_marker(pytest.mark.timeout(minutes * 60 + 900))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture (dense, mixture-of-experts, the
    Phi-3 family's), keyed by arch name."""
    root = tmp_path_factory.mktemp("checkpoints")
    archs = ARCHITECTURES + MOE_ARCHITECTURES + PHI3_ARCHITECTURES
    return {arch: build_tiny_checkpoint(root / arch, arch) for arch in archs}


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The tiny checkpoints' byte-level BPE (512 tokens), saved and loaded back as a
    server loads a checkpoint's tokenizer."""
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


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


@pytest.fixture(scope="session")
def demo_server() -> Iterator[Server]:
    """The demo model served with default flags, as the quick start serves it, for the
    whole session: the modules that drive it as users do (the official client, agent
    libraries, the examples) share it. Each checks it idle and intact after itself."""
    with running_server(DEMO_MODEL_PATH) as s:
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
    parser.addoption(
        "--fuzz-device", default=os.environ.get("SPRIG_FUZZ_DEVICE", "cpu"), choices=["cpu", "cuda"],
        help="where the fuzzer's engines run (default cpu, also on a GPU machine: its reference, "
        "transformers, runs on the CPU; or set SPRIG_FUZZ_DEVICE)",
    )
