"""The offline Engine: each sampling parameter it plumbs, n, seeds, stop strings,
streaming, aborts and rejections — with the KV invariant checked after each."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
from engine_helpers import assert_idle_and_intact, make_prompts

from sprig.runtime import Engine
from sprig.runtime.request_contract import InvalidRequest
from sprig.runtime.sampling.params import SamplingParams
from sprig.runtime.scheduler.intake import RequestRejected
from sprig.runtime.scheduler.request import Req

PROMPT = "the quick fox and the lazy dog"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(tiny_llama, dtype="float32", check_integrity=True) as eng:
        yield eng


@pytest.fixture(autouse=True)
def intact_after(request):
    yield
    if "engine" in request.fixturenames:
        assert_idle_and_intact(request.getfixturevalue("engine"))


def greedy(engine: Engine, prompt: str = PROMPT, **params) -> dict:
    return engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, **params})


def test_max_new_tokens(engine) -> None:
    out = greedy(engine, max_new_tokens=5, ignore_eos=True)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_stop_token_ids_and_min_new_tokens(engine) -> None:
    ref = greedy(engine)["output_ids"]
    out = greedy(engine, stop_token_ids=[ref[2]])
    assert out["output_ids"] == ref[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[2]}
    banned = greedy(engine, stop_token_ids=[ref[0]], min_new_tokens=4, max_new_tokens=6)
    assert ref[0] not in banned["output_ids"][:4]


def test_eos_stops_unless_ignore_eos(engine) -> None:
    eos = engine.tokenizer.eos_token_id
    forced = {"logit_bias": {eos: 100.0}}
    out = greedy(engine, **forced)
    assert out["output_ids"] == [eos] and out["meta_info"]["finish_reason"]["matched"] == eos
    out = greedy(engine, ignore_eos=True, max_new_tokens=4, **forced)
    assert out["output_ids"] == [eos] * 4 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_skip_special_tokens(engine) -> None:
    end = engine.tokenizer.convert_tokens_to_ids("<|end|>")
    params = {"logit_bias": {end: 100.0}, "max_new_tokens": 2}
    assert "<|end|>" not in greedy(engine, **params)["text"]
    assert greedy(engine, skip_special_tokens=False, **params)["text"] == "<|end|><|end|>"


def test_stop_strings_across_tokens_trimmed_or_kept(engine) -> None:
    ref = greedy(engine, max_new_tokens=16, ignore_eos=True)
    text = ref["text"]
    stop = text[3:9]  # spans token boundaries in this tiny vocabulary
    out = greedy(engine, max_new_tokens=16, ignore_eos=True, stop=[stop])
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = greedy(engine, max_new_tokens=16, ignore_eos=True, stop=stop, no_stop_trim=True)
    assert kept["text"] == text[: text.index(stop) + len(stop)]


def test_logit_bias_and_temperature_reach_the_sampler(engine) -> None:
    forced = engine.tokenizer.encode("fox")[-1]
    out = engine.generate(PROMPT, {"max_new_tokens": 3, "temperature": 1.5, "logit_bias": {str(forced): 100}})
    assert out["output_ids"] == [forced] * 3
    outs = engine.generate([PROMPT] * 4, {"max_new_tokens": 8, "temperature": 5.0, "ignore_eos": True})
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # sampled, not greedy


def test_stats_count_extend_and_decode_steps(engine) -> None:
    before = dataclasses.replace(engine.scheduler.stats)
    engine.generate(["one two three", "the cache", "a radix tree of"], {"max_new_tokens": 5, "ignore_eos": True})
    after = engine.scheduler.stats
    # one prefill for the three prompts (their first tokens), then a decode step per token
    assert (after.extend_steps - before.extend_steps, after.decode_steps - before.decode_steps) == (1, 4)
    assert after.steps - before.steps >= 5


@pytest.mark.parametrize("n", [4, 32])
def test_n_samples_share_the_prompt_prefill(engine, n: int) -> None:
    """The prompt is prefilled once; the other samples reuse it together in one more
    extend step, each computing its last token (its own logits)."""
    engine.flush_cache()
    stats = engine.scheduler.stats
    before, steps = stats.prefill_tokens, stats.extend_steps
    outs = engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "n": n, "seed": 3})
    assert len(outs) == n and len({tuple(o["output_ids"]) for o in outs}) > 1
    prompt_len = outs[0]["meta_info"]["prompt_tokens"]
    assert stats.prefill_tokens - before == prompt_len + n - 1  # one token each after the first
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] + [prompt_len - 1] * (n - 1)
    assert stats.extend_steps - steps == 2


def test_seeded_sampling_is_independent_of_the_batch(engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(PROMPT, params)["output_ids"]
    others = make_prompts(5, seed=3)
    mixed = engine.generate([*others[:3], PROMPT, *others[3:]], [{"max_new_tokens": 7}] * 3 + [params] + [{}] * 2)
    assert mixed[3]["output_ids"] == alone
    assert engine.generate(PROMPT, {**params, "seed": 99})["output_ids"] != alone


def test_stream_yields_cumulative_text_ending_in_the_full_output(engine) -> None:
    full = greedy(engine, ignore_eos=True)
    chunks = list(engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}, stream=True))
    assert len(chunks) == 12
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_without_partial_output_a_request_reports_once_everything(engine) -> None:
    full = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}, return_logprob=True)
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams.from_dict({"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    engine.scheduler.add_request(Req(rid="once", prompt_ids=ids, params=params, return_logprob=True))
    reports = []
    while engine.scheduler.has_work:
        reports += engine.scheduler.step(partial=False)
    assert [r.rid for r in reports] == ["once"]
    assert reports[0].new_ids == full["output_ids"] and reports[0].finish_reason is not None
    assert [lp for lp, _ in reports[0].output_logprobs] == [e[0] for e in full["meta_info"]["output_token_logprobs"]]


def test_logprob_options_may_differ_per_prompt(engine) -> None:
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    outs = engine.generate([PROMPT, PROMPT], greedy, return_logprob=[True, False], top_logprobs_num=[2, 0],
                           logprob_start_len=[0, -1])
    alone = engine.generate(PROMPT, greedy, return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    got, want = outs[0]["meta_info"]["output_top_logprobs"], alone["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in row] for row in got] == [[t for _, t, _ in row] for row in want]
    assert [e[0] for row in got for e in row] == pytest.approx([e[0] for row in want for e in row], abs=1e-5)
    assert len(outs[0]["meta_info"]["input_token_logprobs"]) == alone["meta_info"]["prompt_tokens"]
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    with pytest.raises(InvalidRequest, match="top_logprobs_num has 3 entries for 2 prompts") as e:
        engine.generate([PROMPT, PROMPT], greedy, return_logprob=True, top_logprobs_num=[1, 1, 1])
    assert e.value.field == "top_logprobs_num"
    assert_idle_and_intact(engine)


def test_abandoned_stream_aborts_and_frees(engine) -> None:
    stream = engine.generate(PROMPT, {"max_new_tokens": 50, "ignore_eos": True}, stream=True)
    next(stream)
    next(stream)
    stream.close()


def test_abort_by_rid(engine) -> None:
    stream = engine.generate(PROMPT, {"max_new_tokens": 50, "ignore_eos": True}, stream=True, rid="victim")
    next(stream)
    assert engine.scheduler.abort("victim")
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert not engine.scheduler.abort("victim")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampling_params": {"temperature": -1}}, "temperature"),
        ({"sampling_params": {"top_p": 0}}, "top_p"),
        ({"sampling_params": {"max_new_tokens": 10_000}}, "context length"),
        ({"sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
        ({"sampling_params": {"bogus": 1}}, "bogus"),
        ({"sampling_params": {"n": 0}}, "n"),
    ],
)
def test_invalid_requests_are_rejected_by_name(engine, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPT, **kwargs)
    assert greedy(engine, max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_prompt_errors(engine) -> None:
    with pytest.raises(InvalidRequest, match="empty") as e:
        engine.generate(input_ids=[[]])
    assert e.value.field == "input_ids"
    with pytest.raises(InvalidRequest, match="outside"):
        engine.generate(input_ids=[1, 2, 10**7])
    with pytest.raises(InvalidRequest, match="exactly one"):
        engine.generate()
    with pytest.raises(InvalidRequest, match="exceeds"):
        engine.generate(input_ids=[5] * 2000, sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequest, match="context length") as e:
        engine.generate(PROMPT, {"max_new_tokens": 10_000})
    assert e.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequest, match="distinct") as e:
        engine.generate(["a b", "c d"], rid=["x", "x"])
    assert e.value.field == "rid"


def test_pool_too_small_for_a_request(tiny_llama) -> None:
    with Engine(tiny_llama, dtype="float32", max_total_tokens=32) as small:
        with pytest.raises(RequestRejected, match="KV pool"):
            small.generate(PROMPT, {"max_new_tokens": 40})
        assert len(small.generate(PROMPT, {"max_new_tokens": 4, "ignore_eos": True})["output_ids"]) == 4
        assert_idle_and_intact(small)


def test_a_request_mid_chunked_prefill_is_retracted_when_decode_needs_its_slots(tiny_llama) -> None:
    """A pool that holds one request's whole context at most: a second request's prompt,
    prefilled in chunks, fills it while the first decodes. The chunked request gives its
    slots back and prefills again later; both finish as they do alone, input logprobs
    recorded once."""
    prompts = [[5 + i % 50 for i in range(40)], [7 + i % 40 for i in range(50)]]
    params = [{"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}] * 2
    options = {"max_total_tokens": 72, "chunked_prefill_size": 8, "new_token_ratio": 0.0, "min_new_token_ratio": 0.0}
    with Engine(tiny_llama, dtype="float32", check_integrity=True, **options) as small:
        logprobs = {"return_logprob": True, "logprob_start_len": 0}
        both = small.generate(input_ids=prompts, sampling_params=params, **logprobs)
        assert small.scheduler.stats.retractions > 0
        assert sum(o["meta_info"]["num_retractions"] for o in both) == small.scheduler.stats.retractions
        assert_idle_and_intact(small)
        small.flush_cache()
        alone = [small.generate(input_ids=p, sampling_params=params[0], **logprobs) for p in prompts]
    assert [o["output_ids"] for o in both] == [o["output_ids"] for o in alone]
    assert [o["meta_info"]["num_retractions"] for o in alone] == [0, 0]
    for got, want, prompt in zip(both, alone, prompts, strict=True):
        got_input, want_input = got["meta_info"]["input_token_logprobs"], want["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in got_input] == prompt == [t for _, t, _ in want_input]
        assert [lp for lp, _, _ in got_input[1:]] == pytest.approx([lp for lp, _, _ in want_input[1:]], abs=1e-5)


def test_unknown_engine_argument(tiny_llama) -> None:
    with pytest.raises(TypeError, match="unknown engine argument 'max_tokens'"):
        Engine(tiny_llama, max_tokens=3)


def test_sglang_habits_log_level_and_trust_remote_code(tiny_llama) -> None:
    """SGLang programs write `sgl.Engine(model_path=..., log_level="error",
    trust_remote_code=True)`: the level applies to sprig's loggers, the flag runs nothing."""
    logger = logging.getLogger("sprig")
    level = logger.level
    try:
        with Engine(model_path=str(tiny_llama), dtype="float32", log_level="error", trust_remote_code=True) as engine:
            assert logger.getEffectiveLevel() == logging.ERROR
            assert greedy(engine, max_new_tokens=3)["meta_info"]["completion_tokens"] == 3
        with pytest.raises(ValueError, match="log_level must be one of"):
            Engine(tiny_llama, log_level="loud")
    finally:
        logger.setLevel(level)


def test_random_seed_fixes_unseeded_sampling(tiny_llama) -> None:
    """`random_seed` (SGLang's name, `--random-seed` on the server) seeds the draws of
    requests that give no seed of their own: the same seed repeats a run, another differs."""
    hot = {"max_new_tokens": 24, "temperature": 1.5}

    def run(random_seed: int) -> list[list[int]]:
        with Engine(tiny_llama, dtype="float32", random_seed=random_seed) as engine:
            return [o["output_ids"] for o in engine.generate(["the cat", "a dog"], hot)]

    assert run(7) == run(7) != run(8)
