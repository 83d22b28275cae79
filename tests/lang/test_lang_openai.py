"""`OpenAI` builds OpenAI-compatible requests and reads their answers (MockTransport)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import httpx
import pytest

import sprig as sgl

USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}


class FakeOpenAI:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        if body.get("stream"):
            events = [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in ("Bon", "jour")]
            events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                       {"choices": [], "usage": USAGE}]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, content=text.encode())
        if body.get("echo"):
            return httpx.Response(200, json={"choices": [self._echo(i, p) for i, p in enumerate(body["prompt"])],
                                             "usage": USAGE})
        if request.url.path.endswith("/chat/completions"):
            return httpx.Response(200, json={"id": "c1", "usage": USAGE, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "finish_reason": "stop"}]})
        return httpx.Response(200, json={"id": "c2", "usage": USAGE, "choices": [
            {"index": 0, "text": " there", "finish_reason": "length",
             "logprobs": {"tokens": [" there"], "token_logprobs": [-0.25]}}]})

    ECHO: ClassVar[dict[str, list[tuple[str, float | None]]]] = {  # prompt -> its tokens and their logprobs, as an echoing server reports them
        "Q:yes!": [("Q:", None), ("yes", -0.2), ("!", -0.2)],
        "Q:no!": [("Q:", None), ("no", -1.5), ("!", -0.1)],
        "yes!": [("yes", None), ("!", -0.1)],
        "no!": [("no", None), ("!", -5.0)],
    }

    @classmethod
    def _echo(cls, index: int, prompt: str) -> dict[str, Any]:
        tokens = [t for t, _ in cls.ECHO[prompt]]
        offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        logprobs = {"tokens": tokens, "token_logprobs": [lp for _, lp in cls.ECHO[prompt]], "text_offset": offsets}
        return {"index": index, "text": prompt, "logprobs": logprobs}


@pytest.fixture
def fake() -> FakeOpenAI:
    return FakeOpenAI()


def backend(fake: FakeOpenAI) -> sgl.OpenAI:
    return sgl.OpenAI("m", base_url="http://oai.test/v1", api_key="k", transport=httpx.MockTransport(fake))


def test_a_program_without_roles_uses_completions(fake: FakeOpenAI) -> None:
    @sgl.function
    def program(s):
        s += "Hi" + sgl.gen("x", max_tokens=8, temperature=0.2, stop=".", top_k=5, seed=3, return_logprob=True)

    state = program.run(backend=backend(fake))
    assert fake.requests == [("/v1/completions", {
        "model": "m", "prompt": "Hi", "max_tokens": 8, "temperature": 0.2, "top_k": 5, "seed": 3, "stop": ["."],
        "logprobs": 0,
    })]
    assert state.text() == "Hi there"
    assert state.get_meta_info("x")["output_token_logprobs"] == [[-0.25, None, " there"]]
    assert state.cost() == sgl.Cost(calls=1, prompt_tokens=9, cached_tokens=4, completion_tokens=2,
                                    latency_s=state.cost().latency_s, wall_s=state.cost().wall_s)


def test_a_program_with_roles_uses_chat_completions(fake: FakeOpenAI) -> None:
    @sgl.function
    def program(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4, json_schema={"type": "string"}))

    state = program.run(backend=backend(fake))
    path, body = fake.requests[0]
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Capital of France?"}]
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": {"type": "string"}}}
    assert state["a"] == "Paris"
    assert state.messages()[-1] == {"role": "assistant", "content": "Paris"}


def test_a_chat_gen_must_open_the_assistant_message(fake: FakeOpenAI) -> None:
    @sgl.function
    def program(s):
        s += sgl.user("q")
        s += sgl.assistant("Sure: " + sgl.gen("a"))

    with pytest.raises(ValueError, match="right after assistant"):
        program.run(backend=backend(fake))


def test_streaming_chat_deltas_and_usage(fake: FakeOpenAI) -> None:
    @sgl.function
    def program(s):
        s += sgl.user("Say hello in French")
        s += sgl.assistant(sgl.gen("a"))

    state = program.run(backend=backend(fake), stream=True)
    assert "".join(state.text_iter("a")) == "Bonjour"
    assert fake.requests[0][1]["stream_options"] == {"include_usage": True}
    assert state.cost().prompt_tokens == 9 and state.cost().calls == 1


@pytest.mark.parametrize(("method", "expected"), [
    (sgl.token_length_normalized, "yes!"),
    (sgl.unconditional_likelihood_normalized, "no!"),  # "no!" gains more over its context-free likelihood
])
def test_select_uses_echoed_prompt_logprobs(fake: FakeOpenAI, method, expected: str) -> None:
    @sgl.function
    def program(s):
        s += "Q:" + sgl.select("x", choices=["yes!", "no!"], choices_method=method)

    state = program.run(backend=backend(fake))
    path, body = fake.requests[0]
    assert (path, body) == ("/v1/completions", {"model": "m", "prompt": ["Q:yes!", "Q:no!"], "max_tokens": 0,
                                                "echo": True, "logprobs": 0, "temperature": 0})
    meta = state.get_meta_info("x")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.2, -0.8])
    if method is sgl.unconditional_likelihood_normalized:
        assert fake.requests[1][1]["prompt"] == ["yes!", "no!"]
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.15, 1.7])
    assert state["x"] == expected


def test_select_on_a_chat_state_is_a_clear_error(fake: FakeOpenAI) -> None:
    @sgl.function
    def program(s):
        s += sgl.user("pick")
        s += sgl.assistant(sgl.select("x", choices=["a", "b"]))

    with pytest.raises(NotImplementedError, match="/completions"):
        program.run(backend=backend(fake))
