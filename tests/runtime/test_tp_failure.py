"""Tensor parallelism's failures are bounded and named: a model that does not split, a
bad address, or more ranks on CUDA than GPUs, is refused before any rank starts; a rank that exits before joining
fails the start naming it; a rank that stops answering fails the step after
`dist_timeout` instead of hanging it (idle ranks wait for steps without a limit), and the
engine stays failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sprig.runtime import Engine
from sprig.runtime.distributed import runner as runner_module

GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tp_size": 3}, "4 attention heads do not split over 3 ranks"),
    ({"tp_size": 2, "nnodes": 2}, "dist_init_addr"),
    ({"tp_size": 2, "dist_init_addr": "localhost"}, "host:port"),
])
def test_refused_before_any_rank_starts(tiny_llama: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(str(tiny_llama), device="cpu", **kwargs)


def test_ranks_on_cuda_need_a_gpu_each(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA each rank takes a GPU of its own: more ranks on a node than it has GPUs are
    refused before any starts, naming the flags (a machine without CUDA has 0 GPUs)."""
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        pytest.skip("this machine has a GPU for each of two ranks")
    monkeypatch.setattr(runner_module, "spawn_rank", lambda *args: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match=rf"--tp-size 2 over 1 node\(s\) runs 2 .* it has {gpus}: .* --device cpu"):
        Engine(str(tiny_llama), tp_size=2, device="cuda")


@pytest.mark.timeout(120)
def test_a_stopped_rank_fails_the_step_after_the_timeout(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=1024,
                    tp_size=2, dist_timeout=3)
    try:
        assert len(engine.generate("the cat", GREEDY)["output_ids"]) == 4
        time.sleep(4)  # idle past the timeout: the other rank waits for the next step without one
        assert len(engine.generate("the cat", GREEDY)["output_ids"]) == 4
        (rank1,) = engine.runner.ranks.values()
        os.kill(rank1.pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match="the tensor-parallel group failed"):  # not a hang
            engine.generate("the dog", GREEDY)
        with pytest.raises(RuntimeError, match="the tensor-parallel group failed"):  # it stays failed
            engine.generate("the cat", GREEDY)
    finally:
        engine.shutdown()
    assert rank1.poll() is not None  # killed on shutdown


def test_a_rank_that_exits_before_joining_fails_the_start_naming_it(tiny_llama: Path, monkeypatch) -> None:
    def exiting_rank(*args: object) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(runner_module, "spawn_rank", exiting_rank)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code 3"):
        Engine(str(tiny_llama), device="cpu", tp_size=2)
