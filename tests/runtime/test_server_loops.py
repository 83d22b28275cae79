"""The server's process loops driven in-process (no sockets): the message codec, the
scheduler loop's answers to every request (rejections, queue limits, a failing step), the
detokenizer loop, and the stats tracker. Together with `ResponseState` they reproduce the
offline engine's output exactly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest

from sprig.runtime import Engine
from sprig.runtime.detokenizer import RequestDetokenizer
from sprig.runtime.request_contract import (
    LogprobOptions,
    ModelLimits,
    TokenizedRequest,
    build_requests,
)
from sprig.runtime.response import ResponseState
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.server.detokenizer_process import DetokenizerLoop
from sprig.runtime.server.scheduler_process import SchedulerLoop
from sprig.runtime.server.stats import StatsTracker
from sprig.runtime.wire import (
    AbortReq,
    ControlReq,
    DetokenizedBatch,
    DetokenizedOutput,
    DetokRegister,
    Forget,
    StatsReport,
    TokenBatch,
    TokenOutput,
    decode,
    encode,
)

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
NO_LOGPROBS = LogprobOptions()


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    with Engine(tiny_llama, dtype="float32", max_queued_requests=2) as e:
        yield e


@pytest.fixture
def sinks(engine: Engine):
    detok: list[object] = []
    http: list[object] = []
    loop = SchedulerLoop(engine.scheduler, detok.append, http.append, StatsTracker(0.5, 60.0))
    yield loop, detok, http
    assert not engine.scheduler.has_work
    engine.check_integrity()


def req(engine: Engine, rid: str, text: str = "the quick brown fox", *, stream: bool = False,
        logprobs: LogprobOptions = NO_LOGPROBS, **params) -> TokenizedRequest:
    """The request the HTTP process would send (built by the request contract)."""
    return build_requests([engine.tokenizer.encode(text)], {**GREEDY, **params}, engine.limits, rid=rid,
                          new_rid=str, logprobs=logprobs, stream=stream)[0]


def drain(loop: SchedulerLoop) -> None:
    while loop.scheduler.has_work:
        loop.run_step()


def test_codec_round_trips_nested_messages() -> None:
    out = TokenOutput("r", [1, 2], 3, 2, 1, finish_reason={"type": "stop", "matched": "x"},
                      output_logprobs=[[-0.5, 1]], output_top_logprobs=[[[-0.5, 1]]],
                      input_logprobs=[[None, 0], [-1.0, 5]], input_top_logprobs=[None, [[-1.0, 5]]])
    for msg in (
        TokenBatch([out, TokenOutput("s", [], 1, 0, 0)]),
        TokenizedRequest("r", (1, 2), SamplingParams(logit_bias={"5": 1.0}, seed=2**64 - 1, stop=["a", "b"]),
                         LogprobOptions(True, 0, 2, True), stream=True),
        DetokenizedBatch([DetokenizedOutput("r", [3], 1, 1, 0, output_logprobs=[[-0.1, 3, "é"]], text_delta="é")]),
        StatsReport(1, 2, 3, 4, 0.5, 6, 7, 8, 9, 10, 11, 12.5, 13.5, "ok"),
        AbortReq("r"), ControlReq(3, "flush_cache"), Forget(["a", "b"]),
    ):
        assert decode(encode(msg)) == msg


def test_a_request_crosses_as_built_and_is_not_checked_again() -> None:
    """The scheduler side rebuilds a `TokenizedRequest` field by field (tuples stay
    tuples, logit_bias keys ints) without running the contract's checks again; a message
    with a missing or extra field is refused."""
    sent = build_requests([[1, 2, 3]], {"stop": ["x"], "logit_bias": {"3": 2.0}, "n": 2, "seed": 7},
                          ModelLimits(256, 32), rid="r", new_rid=str)
    got = decode(encode(sent))
    assert got == sent and [g.params.seed for g in got] == [7, 8]
    assert got[0].prompt_ids == (1, 2, 3) and got[0].params.stop == ("x",) and got[0].params.logit_bias == {3: 2.0}
    raw = msgpack.unpackb(encode(sent[0]), strict_map_key=False)
    del raw["stream"]
    with pytest.raises(ValueError, match="malformed TokenizedRequest"):
        decode(msgpack.packb(raw))


def test_codec_builds_only_registered_messages() -> None:
    @dataclass
    class Sneaky:
        x: int

    with pytest.raises(TypeError, match="not a registered message"):
        encode(Sneaky(1))
    with pytest.raises(TypeError):
        encode({1, 2})
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb({"__msg__": "Popen", "args": ["sh"]}))
    with pytest.raises(TypeError):
        decode(msgpack.packb({"__msg__": "AbortReq", "rid": "r", "evil": 1}))


def test_every_request_is_answered(engine: Engine, sinks) -> None:
    loop, detok, http = sinks
    loop.handle(req(engine, "good"))
    loop.handle(req(engine, "good"))  # duplicate rid
    assert [(m.rid, m.status) for m in http] == [("good", 400)]
    assert "already in use" in http[0].message
    drain(loop)
    assert isinstance(detok[0], DetokRegister) and detok[0].rid == "good"
    outputs = [o for m in detok[1:] for o in m.outputs]
    assert outputs[-1].finish_reason == {"type": "length", "length": 8} and not loop.live
    loop.idle_maintenance()  # idle after stepping: the KV accounting is checked
    assert loop.stats.integrity == "ok"


def test_queue_full_is_a_503(engine: Engine, sinks) -> None:
    loop, _, http = sinks
    for rid in "abc":
        loop.handle(req(engine, rid))
    assert [(m.rid, m.status) for m in http] == [("c", 503)]
    loop.handle(AbortReq("a"))
    drain(loop)


def test_a_failing_step_answers_live_requests_and_the_loop_goes_on(engine: Engine, sinks, monkeypatch) -> None:
    loop, detok, http = sinks
    loop.handle(req(engine, "x"))
    loop.handle(req(engine, "y", "one two three"))
    loop.run_step()
    monkeypatch.setattr(engine.runner, "forward", lambda step: (_ for _ in ()).throw(RuntimeError("boom")))
    loop.run_step()
    assert sorted((m.rid, m.status) for m in http) == [("x", 500), ("y", 500)]
    assert all("boom" not in m.message and "server log" in m.message for m in http)  # details stay in the log
    assert detok[-1] == Forget(["x", "y"])
    engine.check_integrity()
    monkeypatch.undo()
    loop.handle(req(engine, "z"))
    drain(loop)
    assert detok[-1].outputs[-1].rid == "z" and detok[-1].outputs[-1].finish_reason is not None


def test_control_requests(engine: Engine, sinks) -> None:
    loop, _, http = sinks
    loop.handle(ControlReq(1, "check_integrity"))
    loop.handle(ControlReq(2, "flush_cache"))
    loop.handle(ControlReq(3, "reboot"))
    check, flush, unknown = http
    assert check.ok and check.data["running"] == 0 and check.data["kv_protected"] == 0
    assert flush.ok and not unknown.ok and "reboot" in unknown.data["error"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("with_stop", [False, True])
def test_the_pipeline_reproduces_the_offline_engine(engine: Engine, sinks, stream: bool, with_stop: bool,
                                                    monkeypatch) -> None:
    """scheduler loop -> detokenizer loop -> ResponseState == Engine.generate, stop strings
    and logprob texts included. Each request's text is decoded once: with a stop string by
    the scheduler (step by step, its stop checked on that text; the detokenizer decodes no
    text of it), otherwise by the detokenizer: step by step when streamed, else all at
    once with its last output."""
    loop, detok, http = sinks
    ref = engine.generate("what is the capital", {**GREEDY, "max_new_tokens": 12})
    stop = ref["text"][7:9]
    assert ref["text"].find(stop) == 7, "the test needs text before the stop string"
    params = {**GREEDY, "max_new_tokens": 12, **({"stop": stop} if with_stop else {})}
    expected = engine.generate("what is the capital", params, return_logprob=True, return_text_in_logprobs=True)
    loop.handle(req(engine, "p", "what is the capital", stream=stream, logprobs=LogprobOptions(True, -1, 0, True),
                    **params))
    drain(loop)
    assert all(o.text_delta is not None for m in detok[1:] for o in m.outputs) == with_stop
    texts: list[object] = []
    detokenizer = DetokenizerLoop(engine.tokenizer, texts.append)
    state = ResponseState("p", len(engine.tokenizer.encode("what is the capital")), return_logprob=True)
    decodes: list[int] = []
    step = RequestDetokenizer.step
    monkeypatch.setattr(RequestDetokenizer, "step", lambda self, *a, **k: decodes.append(1) or step(self, *a, **k))
    for msg in [TokenBatch([TokenOutput("ghost", [1], 1, 1, 0)]), *detok]:
        detokenizer.handle(msg)
    assert bool(decodes) != with_stop
    deltas = [out.text_delta for batch in texts for out in batch.outputs]
    for batch in texts:
        for out in batch.outputs:
            state.add(out, 0.0)
    got = state.response
    assert got["text"] == expected["text"] and got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    assert got["meta_info"]["finish_reason"]["type"] == ("stop" if with_stop else "length")
    assert got["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]
    assert not detokenizer.decoders and not http
    assert len(deltas) > 2
    assert sum(bool(d) for d in deltas) > 1 if stream or with_stop else all(not d for d in deltas[:-1])


def test_a_request_that_fails_reaches_http_as_an_error(engine: Engine, sinks) -> None:
    """A grammar that does not compile fails its request after it was queued: the HTTP
    process gets one `RequestError` (400), the detokenizer forgets the request, and no
    output of it is sent."""
    loop, detok, http = sinks
    loop.handle(req(engine, "bad", regex="(unbalanced"))
    assert not http and isinstance(detok[0], DetokRegister)
    drain(loop)
    assert [(m.rid, m.status) for m in http] == [("bad", 400)] and "invalid grammar" in http[0].message
    assert detok[1:] == [Forget(["bad"])]


def test_stats_tracker_reports_while_busy_and_once_idle(engine: Engine) -> None:
    now = [0.0]
    tracker = StatsTracker(0.5, 60.0, clock=lambda: now[0])
    ticks = []
    for t, busy in [(0.1, True), (0.7, True), (0.9, True), (1.3, True), (1.4, False), (2.0, False), (3.0, False)]:
        now[0] = t
        ticks.append(tracker.tick(engine.scheduler, busy=busy) is not None)
    assert ticks == [False, True, False, True, True, False, False]
