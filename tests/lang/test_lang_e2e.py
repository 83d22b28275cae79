"""Frontend programs in the manner of SGLang's test programs, run on the real server
(tiny random checkpoint): structural checks, and the cache reuse the frontend promises
verified through the server's `cached_tokens`."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import sprig as sgl
from sprig import meta

LONG_CONTEXT = "Background: " + " ".join(["the quick brown fox jumps over the lazy dog"] * 12) + "\n"


@pytest.fixture(scope="module")
def endpoint(server):
    yield sgl.RuntimeEndpoint(server.url)
    server.wait_idle()


@pytest.fixture
def backend(endpoint):
    sgl.set_default_backend(endpoint)
    return endpoint


@sgl.function
def few_shot_qa(s, question):
    s += "Q: What is the capital of France?\nA: Paris\nQ: What is two plus two?\nA: four\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)


def test_few_shot_qa(backend) -> None:
    states = few_shot_qa.run_batch([{"question": q} for q in ("Who?", "Where?", "Why?")], progress_bar=False)
    assert all(isinstance(s["answer"], str) and "\n" not in s["answer"] for s in states)
    assert all(s.get_meta_info("answer")["completion_tokens"] <= 8 for s in states)


@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are helpful.")
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=6, temperature=0))


def test_multi_turn_chat(backend) -> None:
    state = multi_turn.run(questions=["hi", "what now?", "and then?"])
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in messages[2::2]] == [state[f"a{i}"] for i in range(3)]


@sgl.function
def choose(s, method):
    s += LONG_CONTEXT + "The best color is "
    s += sgl.select("color", ["red", "green", "blue sky"], choices_method=method)


@pytest.mark.parametrize(
    "method",
    [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized],
)
def test_select_scores_every_choice_over_the_cached_prefix(backend, method) -> None:
    state = choose.run(method=method)
    assert state["color"] in ("red", "green", "blue sky")
    cost = state.cost()
    # the prefix is committed once, then one batched request scores the three choices on it
    assert cost.cached_tokens >= 3 * 100


@sgl.function
def typed(s):
    # room for the longest spelling: the byte-level tokenizer may write "False" in 5 tokens
    s += "A number: " + sgl.gen_int("n", max_tokens=16)
    s += "\nA float: " + sgl.gen("f", dtype=float, max_tokens=16)
    s += "\nTrue or false: " + sgl.gen("b", dtype=bool, max_tokens=8)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_typed_gen(backend, seed) -> None:
    state = typed.run(temperature=0.8, seed=seed)
    assert type(state["n"]) is int and type(state["f"]) is float and type(state["b"]) is bool


JSON_REGEX = r'\{"name": "[a-z]{1,8}", "age": (0|[1-9][0-9]?)\}'  # JSON has no leading zeros


@sgl.function
def json_decode(s):
    s += "Return a person as JSON: " + sgl.gen("person", max_tokens=40, regex=JSON_REGEX)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_through_a_regex(backend, seed) -> None:
    text = json_decode.run(temperature=1.0, seed=seed)["person"]
    assert re.fullmatch(JSON_REGEX, text), text
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@sgl.function
def expert_answer(s, question):
    s += "Question: " + question + "\nWhich expert should answer? "
    s += sgl.select("expert", ["a historian", "a mathematician", "a poet"])
    s += "\nAnswer from " + s["expert"] + ": " + sgl.gen("answer", max_tokens=10, temperature=0)


def test_expert_answer(backend) -> None:
    state = expert_answer.run(question="What is seven times six?")
    assert state["expert"] in ("a historian", "a mathematician", "a poet")
    assert "Answer from " + state["expert"] in state.text()


@sgl.function
def parallel(s, n):
    s += LONG_CONTEXT + "Three ideas:\n"
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f"Idea {i}: " + sgl.gen("idea", max_tokens=6, temperature=0.9)
    forks.join()
    s["ideas"] = [f["idea"] for f in forks]


def test_fork_commits_the_shared_prefix_once(backend, server) -> None:
    server.wait_idle()
    before = server.info()["stats"]
    state = parallel.run(n=4)
    server.wait_idle()
    after = server.info()["stats"]
    assert len(state["ideas"]) == 4 and all(isinstance(i, str) for i in state["ideas"])
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    prefix_tokens = len(LONG_CONTEXT.split()) + 3  # a lower bound on its token count
    assert computed < 2 * prefix_tokens  # the prefix once, plus each branch's few tokens


@sgl.function
def eight_ways(s, context):
    s += context
    forks = s.fork(8)
    for f in forks:
        f += sgl.gen("idea", max_tokens=4, temperature=1.0)
    forks.join()


def test_fork_8_on_a_500_token_prompt_computes_it_once(backend, server) -> None:
    context = " ".join(f"item {i} is {i % 7} and" for i in range(70))
    server.wait_idle()
    sgl.flush_cache()
    before = server.info()["stats"]
    state = eight_ways.run(context=context)
    server.wait_idle()
    after = server.info()["stats"]
    cost = state.cost()
    prompt = cost.prompt_tokens // 9  # the commit plus eight branches, each sees the prompt
    assert prompt >= 500
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    assert computed < prompt + 8 * 8  # the prompt once plus each branch's own few tokens
    assert cost.cached_tokens >= 8 * (prompt - 1)  # every branch found the prompt cached


def test_streaming(backend) -> None:
    state = few_shot_qa.run(question="Which?", stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"]


@sgl.function
def qa_logprobs(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True, max_tokens=16, temperature=0, ignore_eos=True))


def test_stream_logprobs_arrive_per_piece(backend) -> None:
    """SGLang's `test_stream_logprobs`: each piece's meta_info holds its own tokens'
    logprobs, and the counts are cumulative; the bound meta_info holds them all."""

    async def collect(state):
        return [item async for item in state.text_async_iter("answer", return_meta_data=True)]

    state = qa_logprobs.run(question="Tell me about Hawaii.", stream=True)
    pieces = asyncio.run(collect(state))
    seen = 0
    for text, info in pieces:
        assert text and info["completion_tokens"] == info["output_token_logprobs_length"]
        assert len(info["output_token_logprobs"]) == info["completion_tokens"] - seen
        seen = info["completion_tokens"]
    assert "".join(text for text, _ in pieces) == state["answer"]
    whole = qa_logprobs.run(question="Tell me about Hawaii.").get_meta_info("answer")
    streamed = state.get_meta_info("answer")
    assert streamed["output_token_logprobs"] == whole["output_token_logprobs"]
    assert len(whole["output_token_logprobs"]) == 16


@sgl.function
def until_pattern(s, pattern):
    s += LONG_CONTEXT + sgl.gen("out", max_tokens=24, temperature=0, ignore_eos=True, stop_regex=pattern)


def test_gen_stops_at_stop_regex(backend) -> None:
    full = until_pattern.run(pattern=[])["out"]
    piece = full[8:10]
    state = until_pattern.run(pattern=re.escape(piece))
    assert state["out"] == full[: full.index(piece)]
    assert state.get_meta_info("out")["finish_reason"] == {"type": "stop", "matched": re.escape(piece)}


def test_run_batch_sends_a_shared_prefix_once(backend, server) -> None:
    server.wait_idle()
    sgl.flush_cache()
    before = server.info()["stats"]
    questions = [f"Question number {i}?" for i in range(6)]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], num_threads=6, progress_bar=False)
    server.wait_idle()
    after = server.info()["stats"]
    assert len(states) == 6
    cached = sum(s.get_meta_info("answer")["cached_tokens"] for s in states)
    assert cached > 0 and after["cached_tokens"] > before["cached_tokens"]


def test_seeded_samples_are_reproducible_and_nested(backend, server) -> None:
    four = meta.sample(LONG_CONTEXT + "Next:", 4, seed=9, max_tokens=6, temperature=1.0)
    two = meta.sample(LONG_CONTEXT + "Next:", 2, seed=9, max_tokens=6, temperature=1.0)
    other = meta.sample(LONG_CONTEXT + "Next:", 2, seed=90, max_tokens=6, temperature=1.0)
    assert two.texts == four.texts[:2]  # the same seeds give the same samples
    assert len(set(four.texts)) > 1  # each fork has its own seed
    assert other.texts != two.texts
    server.wait_idle()
