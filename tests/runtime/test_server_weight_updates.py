"""The real server's weight updates (SGLang's `/update_weights_from_disk`,
`/update_weight_version`, `/get_weight_version`): after an update `/generate` answers what
transformers generates with the new checkpoint; requests sent while an update waits for
those before it are held and run on the new weights, the earlier ones finish on the old
(each labelled by its weights' version), so no request runs on two sets of weights;
`abort_all_requests` ends the requests in flight; a checkpoint that does not load leaves
the old weights; `/pause_generation` stops generating (requests aborted, retracted or kept
in place) until `/continue_generation`, a paused request's tokens are those of an
unpaused run, and one paused by retraction across an update resumes on the new weights; `/get_weights_by_name` reads back what was loaded; bad bodies are a 400
naming the field. The server is idle and intact
after each test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from engine_helpers import hf_greedy
from server_helpers import Server, running_server
from transformers import AutoModelForCausalLM
from weight_checkpoints import perturbed_copy

from sprig.runtime.server.routes_weights import MAX_PENDING_UPDATES
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

PROMPT = "the quick red fox and the blue dog"
SHORT = {"temperature": 0, "max_new_tokens": 10}
LONG = {"temperature": 0, "max_new_tokens": 6000, "ignore_eos": True}  # runs for many seconds


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny llama with room for long requests, and the same model after a 'training step'."""
    root = tmp_path_factory.mktemp("weights")
    old = build_tiny_checkpoint(root / "old", "llama", max_position_embeddings=8192)
    return old, perturbed_copy(old, root / "new", seed=1)


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path]) -> Iterator[Server]:
    with running_server(checkpoints[0], "--weight-version", "step-0") as s:
        yield s


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> dict[Path, list[int]]:
    return {path: hf_greedy(path, [PROMPT], SHORT["max_new_tokens"])[0] for path in checkpoints}


@pytest.fixture(autouse=True)
def intact_after(server: Server, checkpoints: tuple[Path, Path]) -> Iterator[None]:
    yield
    assert server.post("/continue_generation").status_code == 200
    server.wait_idle()
    back = update(server, {"model_path": str(checkpoints[0]), "weight_version": "step-0"})
    assert back.status_code == 200, back.text


def update(server: Server, body: dict[str, Any]):
    return server.post("/update_weights_from_disk", body)


def generate(server: Server, params: dict[str, Any] = SHORT, **body: Any) -> dict[str, Any]:
    return server.generate({"text": PROMPT, "sampling_params": params, **body})


def model_path(server: Server) -> str:
    return server.get("/get_model_info").json()["model_path"]


def test_sglang_update_flow(server: Server, checkpoints: tuple[Path, Path], expected: dict[Path, list[int]]) -> None:
    """SGLang's own test of the route: the model path follows the weights, a path that does
    not exist changes nothing."""
    old, new = checkpoints
    assert model_path(server) == str(old)
    assert generate(server)["output_ids"] == expected[old]
    r = update(server, {"model_path": str(new)})
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    assert model_path(server) == str(new)
    info = server.info()
    assert info["model_path"] == info["runner"]["model_path"] == str(new)
    out = generate(server)
    assert out["output_ids"] == expected[new] and out["meta_info"]["cached_tokens"] == 0
    r = update(server, {"model_path": str(new.parent / "absent")})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "is not a directory" in r.json()["message"] and f"the weights of {new} are in place" in r.json()["message"]
    assert model_path(server) == str(new)
    assert generate(server)["output_ids"] == expected[new]
    assert server.get("/get_model_info").json()["tokenizer_path"] == str(old)  # the tokenizer stays


def _start_long(server: Server, rid: str, results: dict[str, Any],
                params: dict[str, Any] = LONG) -> threading.Thread:
    """A long streamed request on its own thread; returns once its first tokens arrived.
    `results[rid]`: its last event's line."""
    started = threading.Event()

    def run() -> None:
        body = {"text": PROMPT, "sampling_params": params, "stream": True, "rid": rid}
        with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    results[rid] = line
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    return thread


def _wait_for(server: Server, check) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while not check(state := server.get("/debug/check_integrity").json()):
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    return state


def test_requests_sent_during_an_update_wait_for_it(server: Server, checkpoints: tuple[Path, Path],
                                                    expected: dict[Path, list[int]]) -> None:
    old, new = checkpoints
    streams: dict[str, Any] = {}
    long = [_start_long(server, f"long-{i}", streams) for i in range(2)]
    replies: dict[str, Any] = {}
    updater = threading.Thread(target=lambda: replies.update(
        update=update(server, {"model_path": str(new), "weight_version": "step-1"})))
    updater.start()
    _wait_for(server, lambda s: s["weight_update_pending"])
    waiting = [threading.Thread(target=lambda i=i: replies.update({i: generate(server)})) for i in range(3)]
    waiting.append(threading.Thread(target=lambda: replies.update(dropped=generate(server, rid="dropped"))))
    for t in waiting:
        t.start()
    _wait_for(server, lambda s: s["held_requests"] == 4)
    assert server.post("/abort_request", {"rid": "dropped"}).json()["aborted"]  # held: it ends when released
    labeller = threading.Thread(target=lambda: replies.update(  # sent after the update: applied after it
        label=server.post("/update_weight_version", {"new_version": "step-1b"})))
    labeller.start()
    waiting.append(labeller)
    for i in range(2):  # the long requests still run, on the old weights: stop them
        assert server.post("/abort_request", {"rid": f"long-{i}"}).json()["aborted"]
    for t in [*long, updater, *waiting]:
        t.join(60)
    assert replies["update"].json() == {"success": True, "num_paused_requests": 4,
                                        "message": "Succeeded to update model weights. Weight version updated to step-1."}
    for i in range(3):
        assert replies[i]["output_ids"] == expected[new]
        assert replies[i]["meta_info"]["weight_version"] == "step-1"
    assert replies["label"].json()["new_version"] == "step-1b"
    assert server.get("/get_weight_version").json() == {"weight_version": "step-1b"}
    assert replies["dropped"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert replies["dropped"]["output_ids"] == []
    for rid, last in streams.items():  # what the aborted requests generated came from the old weights
        final = orjson.loads(last.removeprefix("data: "))
        assert final["meta_info"]["finish_reason"]["type"] == "abort", rid
        assert final["meta_info"]["weight_version"] == "step-0"
        assert len(final["output_ids"]) >= SHORT["max_new_tokens"]
        assert final["output_ids"][: SHORT["max_new_tokens"]] == expected[old]


def test_abort_all_requests_ends_the_requests_in_flight(server: Server, checkpoints: tuple[Path, Path],
                                                        expected: dict[Path, list[int]]) -> None:
    old, new = checkpoints
    streams: dict[str, Any] = {}
    long = [_start_long(server, f"doomed-{i}", streams) for i in range(3)]
    r = update(server, {"model_path": str(new), "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["success"], r.text
    for t in long:
        t.join(60)
    for last in streams.values():
        final = orjson.loads(last.removeprefix("data: "))
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert final["output_ids"][: SHORT["max_new_tokens"]] == expected[old]
    assert model_path(server) == str(new)
    assert generate(server)["output_ids"] == expected[new]


def test_weight_versions(server: Server, checkpoints: tuple[Path, Path]) -> None:
    assert server.get("/get_weight_version").json() == {"weight_version": "step-0"}  # --weight-version
    assert generate(server)["meta_info"]["weight_version"] == "step-0"
    r = server.post("/update_weight_version", {"new_version": "step-0b"})
    assert r.json() == {"success": True, "message": "Weight version updated to step-0b", "new_version": "step-0b"}
    assert server.get("/get_weight_version").json() == {"weight_version": "step-0b"}
    events = server.stream("/generate", {"text": PROMPT, "sampling_params": SHORT, "stream": True})
    assert {e["meta_info"]["weight_version"] for e in events[:-1]} == {"step-0b"}
    assert update(server, {"model_path": str(checkpoints[1])}).json()["success"]  # no label: it stays
    assert server.get("/get_model_info").json()["weight_version"] == "step-0b"
    assert server.info()["weight_version"] == "step-0b"
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
    text = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2})
    assert chat.json()["metadata"] == text.json()["metadata"] == {"weight_version": "step-0b"}  # SGLang's field


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
    ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "x" * 5000}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "m", "flush_cache": False}, "flush_cache"),
    ("/update_weights_from_disk", {"model_path": "m", "load_format": "pt"}, "load_format"),
    ("/update_weights_from_disk", {"model_path": "m", "weight_version": ""}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "m", "weight_version": "v" * 300}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "m", "abort_all_requests": "yes"}, "abort_all_requests"),
    ("/update_weight_version", {}, "new_version"),
    ("/update_weight_version", {"new_version": 3}, "new_version"),
    ("/update_weight_version", {"new_version": "v", "abort_all_requests": 1}, "abort_all_requests"),
    ("/pause_generation", {"mode": "later"}, "mode"),
    ("/pause_generation", {"mode": 1}, "mode"),
])
def test_bad_bodies_are_a_400_naming_the_field(server: Server, path: str, body: dict, field: str) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    assert server.get("/get_weight_version").json() == {"weight_version": "step-0"}


def test_openapi_documents_the_bodies(server: Server) -> None:
    doc = server.get("/openapi.json").json()
    body = doc["paths"]["/update_weights_from_disk"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/UpdateWeightsFromDiskRequest"}
    assert doc["components"]["schemas"]["UpdateWeightsFromDiskRequest"]["required"] == ["model_path"]
    assert "/get_weight_version" in doc["paths"]
    pause = doc["paths"]["/pause_generation"]["post"]["requestBody"]
    assert not pause["required"]
    assert doc["components"]["schemas"]["PauseGenerationRequest"]["properties"]["mode"]["enum"] == [
        "abort", "retract", "in_place"]


def test_weights_read_back_by_name(server: Server, checkpoints: tuple[Path, Path]) -> None:
    new = checkpoints[1]
    weights = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict()
    name = "model.layers.1.self_attn.v_proj.weight"
    assert update(server, {"model_path": str(new)}).json()["success"]
    r = server.post("/get_weights_by_name", {"name": name, "truncate_size": 2})
    assert r.status_code == 200 and r.json() == weights[name][:2].tolist(), r.text
    r = httpx.request("GET", server.url + "/get_weights_by_name", json={"name": "model.norm.weight"}, timeout=30)
    assert r.json() == weights["model.norm.weight"].tolist()
    for body, field, reason in [({"name": "model.nope.weight"}, "name", "is no parameter"),
                                ({"name": name, "truncate_size": 0}, "truncate_size", ""),
                                ({"name": 3}, "name", ""), ({}, "name", "")]:
        r = server.post("/get_weights_by_name", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field and reason in r.text, r.text


def test_updates_sent_together_run_in_turn(server: Server, checkpoints: tuple[Path, Path],
                                           expected: dict[Path, list[int]]) -> None:
    old, new = checkpoints
    replies: dict[int, Any] = {}
    order = [new, old, new]
    threads = [threading.Thread(target=lambda i=i, p=p: replies.update(
        {i: update(server, {"model_path": str(p), "weight_version": f"u{i}"})})) for i, p in enumerate(order)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert all(replies[i].json()["success"] for i in range(3))
    version = server.get("/get_weight_version").json()["weight_version"]  # that of the update applied last
    last = order[int(version[1:])]
    assert model_path(server) == str(last)
    out = generate(server)
    assert out["output_ids"] == expected[last] and out["meta_info"]["weight_version"] == version


def test_updates_waiting_their_turn_are_bounded(server: Server, checkpoints: tuple[Path, Path]) -> None:
    streams: dict[str, Any] = {}
    long = _start_long(server, "blocker", streams)  # the first update waits for it
    replies: list[Any] = []
    updaters = [threading.Thread(target=lambda: replies.append(update(server, {"model_path": str(checkpoints[0])})))
                for _ in range(MAX_PENDING_UPDATES)]
    for t in updaters:
        t.start()
    _wait_for(server, lambda s: s["weight_update_pending"])
    deadline = time.monotonic() + 30
    while (r := update(server, {"model_path": str(checkpoints[0])})).status_code != 429:
        assert r.status_code == 200 and time.monotonic() < deadline, r.text  # one slipped in before the others
    assert "weight updates are waiting their turn" in r.json()["error"]["message"] and r.headers["Retry-After"]
    assert server.post("/abort_request", {"rid": "blocker"}).json()["aborted"]
    for t in [long, *updaters]:
        t.join(60)
    assert [x.status_code for x in replies] == [200] * MAX_PENDING_UPDATES


# ---------------------------------------------------------------- pausing generation

PAUSED = {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}  # long enough to pause part-way


def _pause(server: Server, body: dict[str, Any] | None) -> dict[str, Any]:
    r = server.post("/pause_generation", body)
    assert r.status_code == 200, r.text
    return r.json()


def _last(streams: dict[str, Any], rid: str) -> dict[str, Any]:
    return orjson.loads(streams[rid].removeprefix("data: "))


def _settled(streams: dict[str, Any], rid: str) -> list[int]:
    """The tokens `rid` streamed once generation is paused (what was on its way arrived,
    and nothing more comes while paused)."""
    time.sleep(0.3)
    before = _last(streams, rid)["output_ids"]
    time.sleep(0.5)
    assert _last(streams, rid)["output_ids"] == before, "tokens arrived while paused"
    return before


def test_a_request_paused_in_place_gives_its_unpaused_tokens(server: Server, checkpoints: tuple[Path, Path]) -> None:
    """Paused in place, a request keeps its K/V and makes no step: the cache cannot be
    flushed, nor the weights updated (their K/V would be the old weights'); it goes on
    after `/continue_generation` with the tokens of an unpaused run."""
    want = generate(server, PAUSED)["output_ids"]
    streams: dict[str, Any] = {}
    thread = _start_long(server, "kept", streams, PAUSED)
    assert _pause(server, {"mode": "in_place"})["num_requests"] == 1
    state = server.get("/debug/check_integrity").json()
    assert state["ok"] and state["paused"] == "in_place" and state["running"] == 1, state
    so_far = _settled(streams, "kept")
    assert 0 < len(so_far) < PAUSED["max_new_tokens"]
    assert server.post("/flush_cache").status_code == 400
    refused = update(server, {"model_path": str(checkpoints[1])})
    assert refused.status_code == 400 and "paused in place" in refused.json()["message"], refused.text
    assert model_path(server) == str(checkpoints[0])
    assert server.post("/continue_generation").json()["success"]
    thread.join(60)
    final = _last(streams, "kept")
    assert final["output_ids"] == want and final["meta_info"]["finish_reason"]["type"] == "length"


def test_a_request_paused_by_retraction_resumes_on_the_weights_loaded_meanwhile(
        server: Server, checkpoints: tuple[Path, Path], expected: dict[Path, list[int]]) -> None:
    """A pause by retraction leaves nothing holding K/V: the cache flushes and an update
    loads at once. Requests sent while paused wait; after `/continue_generation` they run
    on the new weights, and the retracted request keeps what it wrote and continues as
    the new weights continue it (its prompt and output computed again), labelled with the
    new version."""
    new = checkpoints[1]
    unpaused = generate(server, PAUSED)["output_ids"]
    streams: dict[str, Any] = {}
    thread = _start_long(server, "requeued", streams, PAUSED)
    assert _pause(server, {"mode": "retract"})["num_requests"] == 1
    so_far = _settled(streams, "requeued")
    assert so_far == unpaused[: len(so_far)] and len(so_far) < len(unpaused)
    replies: dict[str, Any] = {}
    sent = threading.Thread(target=lambda: replies.update(short=generate(server)))
    sent.start()
    state = _wait_for(server, lambda s: s["waiting"] == 2)
    assert state["paused"] == "retract" and state["running"] == 0 and state["kv_protected"] == 0, state
    assert server.post("/flush_cache").status_code == 200
    loaded = update(server, {"model_path": str(new), "weight_version": "step-1"})
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    assert server.post("/continue_generation").json()["success"]
    thread.join(60)
    sent.join(60)
    assert replies["short"]["output_ids"] == expected[new]
    assert replies["short"]["meta_info"]["weight_version"] == "step-1"
    final = _last(streams, "requeued")
    assert final["output_ids"][: len(so_far)] == so_far
    assert final["meta_info"]["weight_version"] == "step-1"
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    # The stream may lag the tokens written by those of a character cut across tokens (held
    # back until it is whole): the retraction came after one of the next few. From there
    # on the output is the new weights' greedy continuation of the prompt and what came before.
    prompt_ids = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    out = final["output_ids"]

    def continued_from(k: int) -> bool:
        rest = server.generate({"input_ids": prompt_ids + out[:k], "sampling_params": {**PAUSED, "max_new_tokens": 20}})
        return out[k : k + 20] == rest["output_ids"]

    assert any(continued_from(k) for k in range(len(so_far), len(so_far) + 5) if out[:k] == unpaused[:k])


def test_a_pause_by_abort_ends_the_requests_and_holds_new_ones(server: Server, checkpoints: tuple[Path, Path],
                                                               expected: dict[Path, list[int]]) -> None:
    """The default mode ends the requests in flight (what they wrote is theirs); one sent
    while paused waits for `/continue_generation`."""
    streams: dict[str, Any] = {}
    thread = _start_long(server, "ended", streams, PAUSED)
    assert _pause(server, None) == {"success": True, "message": "Generation paused successfully.", "mode": "abort",
                                    "num_requests": 1}
    thread.join(60)
    assert _last(streams, "ended")["meta_info"]["finish_reason"]["type"] == "abort"
    replies: dict[str, Any] = {}
    sent = threading.Thread(target=lambda: replies.update(held=generate(server)))
    sent.start()
    _wait_for(server, lambda s: s["waiting"] == 1)
    time.sleep(0.3)
    assert "held" not in replies and server.get("/debug/check_integrity").json()["waiting"] == 1
    health = server.get("/health_generate")  # answered at once, not after its probe waited in vain
    assert health.status_code == 503 and "paused" in health.json()["error"]["message"]
    assert server.post("/continue_generation").json() == {"success": True,
                                                          "message": "Generation continued successfully."}
    sent.join(60)
    assert replies["held"]["output_ids"] == expected[checkpoints[0]]
    assert server.get("/health_generate").status_code == 200
