"""Priority scheduling (`enable_priority_scheduling`, SGLang's flags): waiting requests are
admitted by priority (higher values first, or lower with
`schedule_low_priority_values_first`), then in arrival order; a waiting request without
room preempts the running request of the lowest priority when it outranks it by more than
the threshold, and the preempted request resumes to the same output it has alone; a
priority is refused where the scheduler does not take one. The fuzzer runs a quarter of
its workloads this way (engine_fuzz.PRIORITY_SHARE)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from engine_helpers import assert_idle_and_intact
from server_helpers import Server, running_server

from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest, ModelLimits, build_requests
from sprig.runtime.scheduler.intake import RequestRejected
from sprig.runtime.scheduler.request import Req
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

ENGINE = dict(dtype="float32", device="cpu", max_running_requests=1, enable_priority_scheduling=True)
SHORT = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def add(engine: Engine, rid: str, priority: int | None, params: dict[str, Any] = SHORT,
        prompt: tuple[int, ...] = (5, 6, 7)) -> None:
    sched = engine.scheduler
    (req,) = build_requests([list(prompt)], params, ModelLimits(sched.context_len, sched.vocab_size),
                            rid=rid, new_rid=str, priority=priority)
    sched.add_request(Req.of(req))


def finish_order(engine: Engine) -> list[str]:
    done = []
    while engine.scheduler.has_work:
        done += [o.rid for o in engine.scheduler.step() if o.finish_reason is not None]
    return done


@pytest.mark.parametrize(("low_first", "expected"), [(False, ["c", "a", "d", "b"]), (True, ["b", "a", "d", "c"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_llama: Path, low_first: bool,
                                                                expected: list[str]) -> None:
    with Engine(str(tiny_llama), **ENGINE, schedule_low_priority_values_first=low_first) as engine:
        for rid, priority in [("a", 1), ("b", None), ("c", 7), ("d", 1)]:  # None: the default, 0
            add(engine, rid, priority)
        assert finish_order(engine) == expected
        assert engine.scheduler.stats.preemptions == 0  # nothing ran when they arrived
        assert_idle_and_intact(engine)


LONG = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


async def contend(engine: Engine, high: int) -> dict[str, Any]:
    """A low-priority call decoding, then a call of priority `high`: both outputs, and
    whether the first had finished when the second did."""
    low = asyncio.ensure_future(engine.async_generate(input_ids=[5, 6, 7], sampling_params=LONG, priority=0))
    while not engine.scheduler.running or not engine.scheduler.running[0].output_ids:
        await asyncio.sleep(0)  # the low-priority call is decoding
    urgent = await engine.async_generate(input_ids=[9, 10, 11, 12], sampling_params=SHORT, priority=high)
    return {"high": urgent, "low_done_first": low.done(), "low": await low}


def test_a_request_that_outranks_a_running_one_preempts_it(tiny_llama: Path) -> None:
    with Engine(str(tiny_llama), dtype="float32", device="cpu") as plain:
        alone = {"low": plain.generate(input_ids=[5, 6, 7], sampling_params=LONG)["output_ids"],
                 "high": plain.generate(input_ids=[9, 10, 11, 12], sampling_params=SHORT)["output_ids"]}
    for high, threshold, preempted in [(20, 10, True), (5, 10, False), (1, 0, True), (0, 0, False)]:
        with Engine(str(tiny_llama), **ENGINE, priority_scheduling_preemption_threshold=threshold) as engine:
            got = asyncio.run(contend(engine, high))
            case = f"priority {high}, threshold {threshold}"
            assert got["low_done_first"] is not preempted, case
            assert engine.scheduler.stats.preemptions == int(preempted), case
            assert got["low"]["meta_info"]["num_retractions"] == int(preempted), case
            assert got["low"]["output_ids"] == alone["low"] and got["high"]["output_ids"] == alone["high"], case
            assert_idle_and_intact(engine)


def test_priority_is_refused_where_it_is_not_scheduled(tiny_llama: Path) -> None:
    with Engine(str(tiny_llama), dtype="float32", device="cpu") as engine:
        with pytest.raises(InvalidRequest, match="--enable-priority-scheduling") as e:
            engine.generate("a b", SHORT, priority=3)
        assert e.value.field == "priority"
        with pytest.raises(RequestRejected, match="priority"):
            add(engine, "x", 3)
        add(engine, "y", 0)  # the default is no priority at all
        assert finish_order(engine) == ["y"]
    with Engine(str(tiny_llama), **ENGINE) as engine:
        for bad in ("high", True, 2**40, 1.5):
            with pytest.raises(InvalidRequest, match="priority must be a 32-bit integer"):
                engine.generate("a b", SHORT, priority=bad)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("prio") / "llama", "llama", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(long_model: Path) -> Iterator[Server]:
    with running_server(long_model, "--enable-priority-scheduling", "--max-running-requests", "1") as s:
        yield s


def test_server_preempts_for_a_request_of_higher_priority(server: Server, long_model: Path) -> None:
    with Engine(str(long_model), dtype="float32", device="cpu") as plain:
        alone = plain.generate("the quick red fox", {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    events: list[dict] = []
    body = {"text": "a b c", "rid": "background", "stream": True, "priority": 0,
            "sampling_params": {"max_new_tokens": 6000, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:  # the background request is running
            if line.startswith("data: {"):
                break
        urgent = server.generate({"text": "the quick red fox", "priority": 20,
                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert urgent["output_ids"] == alone
        chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                    "priority": 20})
        assert chat.status_code == 200, chat.text
        assert server.post("/abort_request", {"rid": "background"}).json()["aborted"]
        for line in lines:
            if line.startswith("data: {"):
                events.append(orjson.loads(line.removeprefix("data: ")))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    # retracted for the urgent request; for the chat too, unless it was not running again yet
    preempted = events[-1]["meta_info"]["num_retractions"]
    assert preempted in (1, 2)
    server.wait_idle()
    deadline = time.monotonic() + 10  # /metrics counts them once the scheduler's idle report arrives
    while not re.search(rf"^sprig_preemptions_total {preempted}\.0$", text := server.get("/metrics").text, re.M):
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "preemptions" in line]
        time.sleep(0.1)


def test_server_refuses_priority_without_the_flag(tiny_llama: Path) -> None:
    with running_server(tiny_llama) as plain:
        for path, body in [("/generate", {"text": "a", "priority": 1}),
                           ("/v1/completions", {"prompt": "a", "max_tokens": 2, "priority": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "priority": 1})]:
            r = plain.post(path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            assert "--enable-priority-scheduling" in r.json()["error"]["message"]
        r = plain.post("/generate", {"text": "a", "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        plain.wait_idle()
