"""Weights a trainer broadcasts over a process group (SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, and the offline
Engine's methods of those names). A stand-in trainer (`weight_trainer`, its own process,
gloo) holds a second checkpoint's tensors and joins the group as rank 0 the way the RL
frameworks' `init_custom_process_group` does; after the update, greedy tokens are what
transformers generates with that checkpoint (at tp 1 through the server, at tp 2 through
the engine, each rank keeping its slice), and the responses carry the new weight version.
A request that names an unknown tensor or a wrong shape is refused, its tensors received
and dropped so that the trainer's broadcast ends, and the old weights keep serving; one the
body's checks refuse receives nothing; a group is destroyed and joined again."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_idle_and_intact, hf_greedy, make_prompts
from server_helpers import Server, running_server
from weight_checkpoints import perturbed_copy
from weight_trainer import checkpoint_tensors, trainer_main

from sprig.runtime import Engine
from sprig.runtime.processes import free_port

PROMPTS = make_prompts(2, seed=5)
NEW_TOKENS = 8
SHORT = {"temperature": 0, "max_new_tokens": NEW_TOKENS}


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny llama and the same model after a 'training step'."""
    return tiny_llama, perturbed_copy(tiny_llama, tmp_path_factory.mktemp("trained") / "new", seed=3)


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> dict[Path, list[list[int]]]:
    return {path: hf_greedy(path, PROMPTS, NEW_TOKENS) for path in checkpoints}


@pytest.fixture(scope="module")
def metadata(checkpoints: tuple[Path, Path]) -> dict[str, list]:
    """What the trainer posts for every tensor of the trained checkpoint, in its order."""
    tensors = checkpoint_tensors(checkpoints[1])
    names = sorted(tensors)
    return {"names": names, "dtypes": [str(tensors[n].dtype) for n in names],
            "shapes": [list(tensors[n].shape) for n in names]}


class Trainer:
    """The trainer process and its pipe; `call` sends a command and waits for its answer
    on a thread, while the caller makes the engine's side of the collective."""

    def __init__(self, checkpoint: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=trainer_main, args=(child, str(checkpoint)), daemon=True)
        self.proc.start()
        child.close()

    def alongside(self, command: str, arg: Any, engine_side: Callable[[], Any]) -> Any:
        """`engine_side()`'s result, the trainer running `command` at the same time (it must answer ok)."""
        answer: list[str] = []
        self.conn.send((command, arg))
        waiter = threading.Thread(target=lambda: answer.append(_recv(self.conn)))
        waiter.start()
        result = engine_side()
        waiter.join(90)
        assert answer == ["ok"], answer
        return result

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        assert not self.proc.is_alive()


def _recv(conn: Connection) -> str:
    return conn.recv() if conn.poll(90) else "no answer within 90 s"


@pytest.fixture
def trainer(checkpoints: tuple[Path, Path]) -> Iterator[Trainer]:
    t = Trainer(checkpoints[1])
    try:
        yield t
    finally:
        t.stop()


def group(port: int, world_size: int = 2, name: str = "weight_update_group") -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
            "group_name": name, "backend": "gloo"}


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path]) -> Iterator[Server]:
    with running_server(checkpoints[0], "--weight-version", "step-0") as s:
        yield s


def tokens(server: Server) -> tuple[list[list[int]], list[str]]:
    outs = [server.generate({"text": p, "sampling_params": SHORT}) for p in PROMPTS]
    return [o["output_ids"] for o in outs], [o["meta_info"]["weight_version"] for o in outs]


def test_server_takes_the_weights_a_trainer_broadcasts(server: Server, trainer: Trainer, checkpoints: tuple[Path, Path],
                                                        expected: dict[Path, list[list[int]]],
                                                        metadata: dict[str, list]) -> None:
    old, new = checkpoints
    for bad, field in [({**group(1), "rank_offset": 0}, "rank_offset"), ({**group(1), "backend": "mpi"}, "backend"),
                       ({**group(1), "world_size": 1}, "world_size"), ({**group(1), "backend": "nccl"}, "nccl")]:
        r = server.post("/init_weights_update_group", bad)
        assert r.status_code == 400 and field in r.text, r.text
    port = free_port("127.0.0.1")
    r = trainer.alongside("join", (port, 2, "weight_update_group"),
                          lambda: server.post("/init_weights_update_group", group(port)))
    assert r.status_code == 200 and r.json()["success"], r.text
    assert server.post("/init_weights_update_group", group(free_port("127.0.0.1"))).status_code == 400  # name taken

    unknown = {**metadata, "names": ["model.layers.0.mlp.nope.weight", *metadata["names"][1:]]}
    misshaped = {**metadata, "shapes": [[3, 3], *metadata["shapes"][1:]]}
    for bad, words in [(unknown, "nope"), (misshaped, "[3, 3]")]:  # the trainer broadcasts what it posted
        r = trainer.alongside("send_zeros", list(zip(bad["shapes"], bad["dtypes"], strict=True)),
                              lambda bad=bad: server.post("/update_weights_from_distributed", bad))
        assert r.status_code == 400 and words in r.text and "received and dropped" in r.text, r.text
    short = {**metadata, "dtypes": metadata["dtypes"][1:]}
    huge = {**metadata, "names": ["nope"], "dtypes": ["float32"], "shapes": [[1 << 20, 1 << 20]]}
    for bad, words in [(short, "one entry per tensor"), ({**metadata, "group_name": "other"}, "other"),
                       ({**metadata, "dtypes": ["int64"] * 99}, ""), (huge, "nothing was received")]:
        r = server.post("/update_weights_from_distributed", bad)
        assert r.status_code == 400 and words in r.text, r.text
    assert tokens(server) == (expected[old], ["step-0"] * len(PROMPTS))

    body = {**metadata, "weight_version": "step-1", "flush_cache": False}
    r = trainer.alongside("send", metadata["names"], lambda: server.post("/update_weights_from_distributed", body))
    assert r.status_code == 200 and r.json()["success"], r.text
    assert tokens(server) == (expected[new], ["step-1"] * len(PROMPTS))
    assert server.get("/get_weight_version").json()["weight_version"] == "step-1"

    assert server.post("/destroy_weights_update_group", {"group_name": "weight_update_group"}).status_code == 200
    assert server.post("/destroy_weights_update_group", {}).status_code == 400  # none left by that name
    assert trainer.alongside("leave", None, lambda: None) is None
    assert server.post("/update_weights_from_distributed", metadata).status_code == 400  # no group

    port = free_port("127.0.0.1")
    r = trainer.alongside("join", (port, 2, "weight_update_group"),
                          lambda: server.post("/init_weights_update_group", group(port)))
    assert r.status_code == 200, r.text
    first = {"name": metadata["names"][0], "dtype": metadata["dtypes"][0], "shape": metadata["shapes"][0],
             "weight_version": "step-2"}  # SGLang's earlier one-tensor form
    r = trainer.alongside("send", [first["name"]], lambda: server.post("/update_weights_from_distributed", first))
    assert r.status_code == 200 and "(1 tensors)" in r.json()["message"], r.text
    assert tokens(server) == (expected[new], ["step-2"] * len(PROMPTS))  # the same tensor again: nothing changes
    assert server.post("/destroy_weights_update_group", {}).status_code == 200
    server.wait_idle()


def test_every_tensor_parallel_rank_keeps_its_slice(trainer: Trainer, checkpoints: tuple[Path, Path],
                                                    expected: dict[Path, list[list[int]]],
                                                    metadata: dict[str, list]) -> None:
    old, new = checkpoints
    with Engine(str(old), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=2048, tp_size=2,
                weight_version="v0") as engine:
        port = free_port("127.0.0.1")
        spec = group(port, world_size=3)
        ok, message = trainer.alongside("join", (port, 3, "weight_update_group"),
                                        lambda: engine.init_weights_update_group(**spec))
        assert ok, message
        misshaped = {**metadata, "shapes": [[1], *metadata["shapes"][1:]]}
        ok, message = trainer.alongside("send_zeros", list(zip(misshaped["shapes"], misshaped["dtypes"], strict=True)),
                                        lambda: engine.update_weights_from_distributed(**misshaped))
        assert not ok and "[1]" in message and "received and dropped" in message, message
        ok, message = trainer.alongside("send", metadata["names"],
                                        lambda: engine.update_weights_from_distributed(**metadata, weight_version="v1"))
        assert ok, message
        outs = engine.generate(PROMPTS, SHORT)
        assert [o["output_ids"] for o in outs] == expected[new]
        assert {o["meta_info"]["weight_version"] for o in outs} == {"v1"}
        assert engine.destroy_weights_update_group() == (True, "Succeeded to destroy weight-update group "
                                                                "'weight_update_group'.")
        assert_idle_and_intact(engine)


def test_a_join_that_times_out_leaves_nothing_joined(tiny_llama: Path) -> None:
    with Engine(str(tiny_llama), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=512) as engine:
        engine.runner.weight_groups.join_timeout_s = 1.0
        ok, message = engine.init_weights_update_group(**group(free_port("127.0.0.1")))  # no trainer listens
        assert not ok and "could not join weight-update group 'weight_update_group'" in message
        assert engine.runner.weight_groups.groups == {}
        assert engine.destroy_weights_update_group() == (
            False, "group_name 'weight_update_group': no weight-update group of that name is joined")
        ok, message = engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        assert not ok and "no weight-update group" in message
