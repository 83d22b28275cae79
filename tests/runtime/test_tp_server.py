"""Tensor parallelism through the real server: `sprig serve --tp-size 2` (and the same
group spread over two "nodes" of one process each, over gloo on 127.0.0.1; on the CPU, also
on a GPU machine) answers
/generate with the greedy tokens and logprobs of TP=1, and constrained decoding holds; a rank that dies makes the server
unhealthy and exit 1, the log naming the rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Server, pid_alive, running_server
from test_server_liveness import health_or_gone, wait_for_exit

from sprig.runtime import Engine
from sprig.runtime.processes import free_port

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
PROMPTS = ["the quick fox", "one two three four five six", "what is the cache of the tree", "a red dog"]


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["qwen2"]  # q/k/v biases


@pytest.fixture(scope="module")
def expected(qwen2: Path) -> list[dict]:
    with Engine(str(qwen2), dtype="float32", device="cpu", max_total_tokens=2048) as engine:
        return engine.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0)


def assert_same_as_tp1(server: Server, expected: list[dict]) -> None:
    for prompt, want in zip(PROMPTS, expected, strict=True):
        got = server.generate({"text": prompt, "sampling_params": GREEDY, "return_logprob": True,
                               "logprob_start_len": 0})
        assert got["output_ids"] == want["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            pairs = list(zip(got["meta_info"][key], want["meta_info"][key], strict=True))
            assert all(a[1] == b[1] for a, b in pairs)
            assert max(abs(a[0] - b[0]) for a, b in pairs if b[0] is not None) < 1e-4


def rank_pids(parent: int) -> list[int]:
    """The tensor-parallel rank processes `parent` started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"sprig.runtime.distributed.rank" in cmdline:
            pids.append(int(entry))
    return pids


def test_tp2_server_matches_tp1_and_dies_naming_a_killed_rank(qwen2: Path, expected: list[dict]) -> None:
    with running_server(qwen2, "--tp-size", "2", "--device", "cpu", "--max-total-tokens", "2048", exit_code=1) as server:
        assert server.info()["model"]["tp_size"] == 2
        assert_same_as_tp1(server, expected)
        constrained = server.generate({"text": PROMPTS[0], "sampling_params": {
            "max_new_tokens": 12, "temperature": 1.0, "regex": "(yes|no), [0-9]{3}"}})
        assert re.fullmatch("(yes|no), [0-9]{3}", constrained["text"]), constrained  # the grammar runs on rank 0
        (rank1,) = rank_pids(server.pids["scheduler"])
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while health_or_gone(server) == 200:
            assert time.monotonic() < deadline, "/health stayed 200 with a dead rank"
            time.sleep(0.2)
        assert wait_for_exit(server, 30) == 1
        assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in server.log.read_text()


@pytest.fixture
def second_node(qwen2: Path) -> Iterator[tuple[list[str], subprocess.Popen, Path]]:
    """Node 1 of a two-node group (one rank each), started before node 0 has a server."""
    flags = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port('127.0.0.1')}",
             "--dist-timeout", "60", "--device", "cpu"]
    fd, name = tempfile.mkstemp(prefix="sprig-test-node1-", suffix=".log")
    cmd = [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(qwen2), "--dtype", "float32",
           "--max-total-tokens", "2048", *flags, "--node-rank", "1"]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    os.close(fd)
    try:
        yield flags, proc, Path(name)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        Path(name).unlink()


def test_two_nodes_over_gloo_match_tp1(qwen2: Path, expected: list[dict], second_node) -> None:
    flags, node1, log = second_node
    with running_server(qwen2, *flags, "--node-rank", "0", "--max-total-tokens", "2048") as server:
        assert rank_pids(server.pids["scheduler"]) == []  # rank 1 is the other node's
        assert_same_as_tp1(server, expected)
    assert node1.wait(30) == 0, log.read_text()  # the server's rank 0 sent stop on its way out
    assert "rank 0 sent stop" in log.read_text()
    assert not pid_alive(node1.pid)
