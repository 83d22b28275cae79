"""`Engine.async_generate`: concurrent calls on one event loop batch together, and each
gets what `generate` gives it alone; streams, cancelled calls, bad arguments and
SGLang's offline-engine style (`sgl.Engine`)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from engine_helpers import assert_idle_and_intact, make_prompts

import sprig as sgl
from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest
from sprig.runtime.scheduler.intake import RequestRejected

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 11, "ignore_eos": True}
LONG = {"max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    with Engine(tiny_llama, dtype="float32", check_integrity=True) as eng:
        yield eng


async def _settled(engine: Engine) -> None:
    """Until the engine has retired every request (`flush_cache` refuses while any runs)."""
    while not engine.flush_cache():
        await asyncio.sleep(0.01)


def test_concurrent_calls_batch_and_each_equals_itself_alone(engine: Engine) -> None:
    prompts = make_prompts(4, seed=3)
    params = [GREEDY, SEEDED, GREEDY | {"max_new_tokens": 5}, SEEDED | {"n": 2}]
    steps = engine.scheduler.stats.decode_steps
    alone = [engine.generate(p, sp, return_logprob=True) for p, sp in zip(prompts, params, strict=True)]
    alone_steps = engine.scheduler.stats.decode_steps - steps

    async def together() -> list:
        calls = [engine.async_generate(p, sp, return_logprob=True) for p, sp in zip(prompts, params, strict=True)]
        return await asyncio.gather(*calls)

    steps = engine.scheduler.stats.decode_steps
    outs = asyncio.run(together())
    assert engine.scheduler.stats.decode_steps - steps < alone_steps / 2  # one batch, not one call after another
    for got, want in zip(outs, alone, strict=True):
        got, want = (got, want) if isinstance(want, list) else ([got], [want])
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert [o["text"] for o in got] == [o["text"] for o in want]
        for g, w in zip(got, want, strict=True):
            got_lps = [e[0] for e in g["meta_info"]["output_token_logprobs"]]
            assert got_lps == pytest.approx([e[0] for e in w["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert_idle_and_intact(engine)


def test_a_stream_yields_cumulative_text_ending_in_the_whole_output(engine: Engine) -> None:
    prompt = make_prompts(1, seed=5)[0]
    whole = engine.generate(prompt, GREEDY)

    async def stream() -> list:
        return [chunk async for chunk in await engine.async_generate(prompt, GREEDY, stream=True)]

    chunks = asyncio.run(stream())
    assert len(chunks) > 1
    assert all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(chunks))
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert_idle_and_intact(engine)


def test_a_batch_streams_each_output_with_its_index(engine: Engine) -> None:
    prompts = make_prompts(2, seed=8)
    whole = engine.generate(prompts, GREEDY | {"n": 2})

    async def stream() -> list:
        return [chunk async for chunk in await engine.async_generate(prompts, GREEDY | {"n": 2}, stream=True)]

    for chunks in (list(engine.generate(prompts, GREEDY | {"n": 2}, stream=True)), asyncio.run(stream())):
        last = {c["index"]: c for c in chunks}
        assert sorted(last) == [0, 1, 2, 3]
        assert [last[i]["output_ids"] for i in range(4)] == [o["output_ids"] for o in whole]
    assert "index" not in next(iter(engine.generate(prompts[0], GREEDY, stream=True)))
    assert_idle_and_intact(engine)


def test_a_cancelled_call_or_a_closed_stream_frees_its_slots(engine: Engine) -> None:
    prompt = make_prompts(1, seed=6)[0]

    async def main() -> dict:
        slow = asyncio.create_task(engine.async_generate(prompt, LONG))
        stream = await engine.async_generate(prompt, LONG, stream=True)
        async for chunk in stream:
            if chunk["meta_info"]["completion_tokens"] >= 3:
                break
        await stream.aclose()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        done = await engine.async_generate(prompt, GREEDY)  # the engine goes on serving
        await _settled(engine)
        return done

    assert asyncio.run(main())["output_ids"] == engine.generate(prompt, GREEDY)["output_ids"]
    assert_idle_and_intact(engine)


def test_calls_left_behind_when_the_event_loop_ends_are_aborted(engine: Engine) -> None:
    """A stream left without closing it and a call never awaited, when `asyncio.run`
    returns: the engine aborts their requests, and `generate` runs after."""
    prompt = make_prompts(1, seed=7)[0]

    async def main() -> None:
        stream = await engine.async_generate(prompt, LONG, stream=True)
        async for chunk in stream:
            if chunk["meta_info"]["completion_tokens"] >= 3:
                break
        never_awaited = asyncio.create_task(engine.async_generate(prompt, LONG))
        await asyncio.sleep(0.01)
        assert not never_awaited.done()

    asyncio.run(main())
    assert engine.generate(prompt, GREEDY)["meta_info"]["completion_tokens"] == 16
    assert_idle_and_intact(engine)


def test_bad_calls_raise_and_leave_nothing_running(engine: Engine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequest, match="temperature") as e:
            await engine.async_generate("a", {"temperature": -1})
        assert e.value.field == "sampling_params"
        with pytest.raises(InvalidRequest, match="return_logprob has 1 entries for 2 prompts"):
            await engine.async_generate(["a", "b"], GREEDY, return_logprob=[True])
        running = await engine.async_generate("a cat", GREEDY, rid="taken", stream=True)
        await anext(running)  # its request is in the scheduler
        with pytest.raises(RequestRejected, match="'taken' is already in use"):  # after "fresh" was added
            await engine.async_generate(["a dog", "a fox"], GREEDY, rid=["fresh", "taken"])
        assert [c async for c in running][-1]["meta_info"]["completion_tokens"] == 16
        await _settled(engine)
        assert "fresh" not in {r.rid for r in engine.scheduler.waiting + engine.scheduler.running}

    asyncio.run(main())
    assert_idle_and_intact(engine)


def test_generate_refuses_to_run_beside_async_calls(engine: Engine) -> None:
    async def main() -> None:
        call = asyncio.create_task(engine.async_generate("the cat", GREEDY))
        await asyncio.sleep(0)  # the call has started
        with pytest.raises(RuntimeError, match="async_generate calls are in flight"):
            engine.generate("the dog", GREEDY)
        assert not engine.flush_cache()
        await call
        await _settled(engine)

    asyncio.run(main())
    assert engine.flush_cache()
    assert_idle_and_intact(engine)


def test_async_generate_refuses_to_run_beside_a_generate_stream(engine: Engine) -> None:
    unread = engine.generate("the cat", GREEDY, stream=True)
    assert not engine.scheduler.has_work  # a stream starts its requests when read
    stream = engine.generate("the cat", GREEDY, stream=True)
    next(stream)

    async def call() -> dict:
        return await engine.async_generate("the dog", GREEDY)

    with pytest.raises(RuntimeError, match="a generate stream is being read"):
        asyncio.run(call())
    stream.close()
    unread.close()
    assert asyncio.run(call())["meta_info"]["completion_tokens"] == 16
    assert_idle_and_intact(engine)


def test_shutdown_ends_the_calls_in_flight(tiny_llama: Path) -> None:
    eng = Engine(tiny_llama, dtype="float32")

    async def main() -> None:
        call = asyncio.create_task(eng.async_generate("the cat", LONG))
        stream = await eng.async_generate("the dog", LONG, stream=True)
        await anext(stream)
        eng.shutdown()
        for pending in (call, anext(stream)):
            with pytest.raises(RuntimeError, match="the engine shut down"):
                await pending
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            await eng.async_generate("a fox", GREEDY)

    asyncio.run(main())


def test_sglang_offline_engine_style(tiny_llama: Path) -> None:
    """SGLang's offline-engine quick start, with `import sprig as sgl`."""
    assert sgl.Engine is Engine
    llm = sgl.Engine(model_path=str(tiny_llama), dtype="float32")
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 8, "seed": 3}
    outputs = llm.generate(prompts, sampling_params)

    async def main() -> list[str]:
        texts = []
        for prompt in prompts:
            generator = await llm.async_generate(prompt, sampling_params, stream=True)
            async for chunk in generator:
                last = chunk["text"]
            texts.append(last)
        return texts

    assert asyncio.run(main()) == [o["text"] for o in outputs]
    llm.shutdown()


@pytest.mark.gpu
def test_async_calls_on_cuda_capture_and_replay_graphs_from_the_worker_thread(tiny_llama: Path) -> None:
    """On CUDA the model runs on the engine's worker thread: decode graphs captured there
    (first use async) or on the caller's thread (first use `generate`) replay to the same
    tokens."""
    prompts = make_prompts(6, seed=9)
    outs = {}
    for first in ("async", "sync"):
        with Engine(str(tiny_llama), device="cuda", dtype="float32") as eng:
            async def together(eng: Engine = eng) -> list:
                return await asyncio.gather(*(eng.async_generate(p, GREEDY, return_logprob=True) for p in prompts))

            if first == "async":
                outs[first] = asyncio.run(together())
            else:
                outs[first] = [eng.generate(p, GREEDY, return_logprob=True) for p in prompts]
                assert [o["output_ids"] for o in asyncio.run(together())] == [o["output_ids"] for o in outs[first]]
            assert eng.runner.graphs is not None and eng.runner.graphs.captured
            assert_idle_and_intact(eng)
    for a, b in zip(outs["async"], outs["sync"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        got = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx([e[0] for e in b["meta_info"]["output_token_logprobs"]], abs=1e-4)
