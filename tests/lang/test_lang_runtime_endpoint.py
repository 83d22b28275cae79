"""`RuntimeEndpoint` sends the exact native `/generate` payloads (captured through
`httpx.MockTransport`) and reads SGLang-format answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import sprig as sgl
from sprig.backend import RuntimeEndpoint, ServerError
from sprig.runtime.tiny_checkpoint import CHAT_TEMPLATE

MODEL_INFO = {"model_path": "/models/tiny", "is_generation": True, "chat_template": CHAT_TEMPLATE,
              "bos_token": "<s>"}


def meta(prompt_tokens: int, completion_tokens: int = 0, cached: int = 0, **extra: Any) -> dict[str, Any]:
    return {"id": "r", "finish_reason": {"type": "length", "length": completion_tokens},
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": cached, "e2e_latency": 0.5, **extra}


class FakeServer:
    """Records every request; `answer(payload)` makes each `/generate` answer."""

    def __init__(self, answer: Callable[[dict[str, Any]], Any]) -> None:
        self.answer = answer
        self.requests: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        result = self.answer(body)
        if isinstance(result, httpx.Response):
            return result
        return httpx.Response(200, json=result)

    def generates(self) -> list[dict[str, Any]]:
        return [body for _, path, body in self.requests if path == "/generate"]

    def endpoint(self) -> RuntimeEndpoint:
        return RuntimeEndpoint("http://sprig.test", api_key="k", transport=httpx.MockTransport(self))


def test_model_info_gives_the_chat_template() -> None:
    endpoint = FakeServer(lambda body: None).endpoint()
    assert endpoint.get_model_name() == "/models/tiny"
    assert endpoint.chat_template.roles["user"] == ("<|user|>\n", "<|end|>\n")
    assert endpoint.chat_template.stop_str == ("<|end|>",)


def test_gen_payload() -> None:
    server = FakeServer(lambda body: {"text": "Paris", "output_ids": [5, 6], "meta_info": meta(7, 2, 3)})

    @sgl.function
    def program(s):
        s += sgl.user("Capital?")
        s += sgl.assistant(sgl.gen("a", max_tokens=16, stop="\n", temperature=0.5, top_k=4, seed=7,
                                   return_logprob=True, top_logprobs_num=2))

    state = program.run(backend=server.endpoint())
    assert server.generates() == [{
        "text": "<|user|>\nCapital?<|end|>\n<|assistant|>\n",
        "sampling_params": {"max_new_tokens": 16, "stop": ["\n", "<|end|>"], "temperature": 0.5, "top_k": 4,
                            "sampling_seed": 7},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }]
    assert state["a"] == "Paris"
    assert state.get_meta_info("a")["cached_tokens"] == 3
    assert state.cost() == sgl.Cost(calls=1, prompt_tokens=7, cached_tokens=3, completion_tokens=2,
                                    latency_s=0.5, wall_s=0.5)


def test_typed_gen_sends_the_dtype_regex() -> None:
    server = FakeServer(lambda body: {"text": "12", "meta_info": meta(3, 1)})

    @sgl.function
    def program(s):
        s += "n=" + sgl.gen_int("n", max_tokens=4)

    assert program.run(backend=server.endpoint())["n"] == 12
    assert server.generates()[0]["sampling_params"] == {
        "max_new_tokens": 4, "stop": ["<|end|>", " ", "\n"], "regex": sgl.REGEX_INT,
    }


def test_n_samples_read_a_list_answer() -> None:
    server = FakeServer(lambda body: [{"text": t, "meta_info": meta(2, 1)} for t in ("a", "b")])

    @sgl.function
    def program(s):
        s += "x" + sgl.gen("v", n=2)

    state = program.run(backend=server.endpoint())
    assert server.generates()[0]["sampling_params"]["n"] == 2
    assert state["v"] == ["a", "b"]
    assert state.cost().prompt_tokens == 4 and state.cost().calls == 1


def score_answer(body: dict[str, Any]) -> Any:
    if body["sampling_params"] == {"max_new_tokens": 0} and "text" in body:
        return {"text": "", "meta_info": meta(4, cached=0)}  # the prefix commit
    if "input_ids" in body:  # the choices alone
        return [{"text": "", "meta_info": meta(len(ids), input_token_logprobs=[
            [None if i == 0 else -1.0, t, None] for i, t in enumerate(ids)])} for ids in body["input_ids"]]
    entries = {
        "Answer: yes": [[-0.1, 10, " "], [-0.5, 11, "yes"], [-0.3, 12, "!"]],  # boundary kept
        "Answer: no": [[-2.0, 13, " no"]],  # " " merged into " no": token healing
    }
    return [{"text": "", "meta_info": meta(4, cached=3, input_token_logprobs=entries[t])} for t in body["text"]]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.unconditional_likelihood_normalized])
def test_select_commits_the_prefix_then_scores_all_choices_in_one_request(method) -> None:
    server = FakeServer(score_answer)

    @sgl.function
    def program(s):
        s += "Answer: " + sgl.select("x", choices=["yes", "no"], choices_method=method)

    state = program.run(backend=server.endpoint())
    requests = server.generates()
    assert requests[:2] == [
        {"text": "Answer: ", "sampling_params": {"max_new_tokens": 0}},
        {"text": ["Answer: yes", "Answer: no"],
         "sampling_params": {"max_new_tokens": 0, "temperature": 0},
         "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 3},
    ]
    scores = state.get_meta_info("x")
    assert scores["input_token_logprobs"] == [[[-0.5, 11, "yes"], [-0.3, 12, "!"]], [[-2.0, 13, " no"]]]
    assert scores["normalized_prompt_logprobs"] == pytest.approx([-0.4, -2.0])
    assert state["x"] == "yes"
    if method is sgl.unconditional_likelihood_normalized:
        assert len(requests) == 3
        assert requests[2] == {"input_ids": [[11, 12], [13]], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                               "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0}
        assert scores["normalized_unconditional_prompt_logprobs"] == pytest.approx([(-0.5 + -0.3 + 1.0) / 2, -2.0])
        assert state.cost().calls == 3
    else:
        assert len(requests) == 2
        assert state.cost() == sgl.Cost(calls=2, prompt_tokens=12, cached_tokens=6, latency_s=1.0, wall_s=1.0)


def test_fork_commits_the_shared_prefix_once_before_the_branches() -> None:
    server = FakeServer(lambda body: {"text": "" if body["sampling_params"] == {"max_new_tokens": 0} else "b",
                                      "meta_info": meta(5, cached=5)})

    @sgl.function
    def program(s):
        s += "shared prefix"
        forks = s.fork(3)
        forks += sgl.gen("x", max_tokens=2)
        forks.join()

    state = program.run(backend=server.endpoint())
    first, *branches = server.generates()
    assert first == {"text": "shared prefix", "sampling_params": {"max_new_tokens": 0}}
    assert branches == [{"text": "shared prefix", "sampling_params": {"max_new_tokens": 2, "stop": ["<|end|>"]}}] * 3
    assert state["x"] == ["b", "b", "b"]
    assert state.cost().calls == 4 and state.cost().cached_tokens == 20


def sse(*events: Any) -> httpx.Response:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_streaming_reads_cumulative_sse_text() -> None:
    server = FakeServer(lambda body: sse(
        {"text": "Hel", "meta_info": meta(2, 1)},
        {"text": "Hello", "meta_info": meta(2, 2)},
        {"text": "Hello!", "meta_info": meta(2, 3)},
    ))

    @sgl.function
    def program(s):
        s += ">" + sgl.gen("g", max_tokens=8)

    state = program.run(backend=server.endpoint(), stream=True)
    assert "".join(state.text_iter("g")) == "Hello!"
    assert server.generates()[0] == {"text": ">", "sampling_params": {"max_new_tokens": 8, "stop": ["<|end|>"]},
                                     "stream": True}
    assert state.text() == ">Hello!"
    assert state.cost().completion_tokens == 3 and state.cost().calls == 1


def _lp(*ids: int) -> list[list[Any]]:
    return [[-0.1 * i, i, None] for i in ids]


@pytest.mark.parametrize("incremental", [True, False])
def test_streamed_logprobs_incremental_or_cumulative_reach_text_async_iter(incremental) -> None:
    """Current servers send each event's new logprob entries (with the cumulative count);
    older ones the whole list so far. Either way the bound meta_info is cumulative and
    `text_async_iter(return_meta_data=True)` gives each piece its own entries."""
    ids = [[1], [2, 3], [4], []]  # the last event brings no token (e.g. a finish with no text)
    texts = ["A", "ABC", "ABCD", "ABCD"]
    events, total = [], []
    for new, text in zip(ids, texts, strict=True):
        total += new
        entries = _lp(*(new if incremental else total))
        events.append({"text": text, "meta_info": meta(2, len(total), output_token_logprobs=entries,
                                                      output_token_logprobs_length=len(total))})
    server = FakeServer(lambda body: sse(*events))

    @sgl.function
    def program(s):
        s += ">" + sgl.gen("g", max_tokens=8, return_logprob=True)

    async def collect(state):
        return [item async for item in state.text_async_iter("g", return_meta_data=True)]

    state = program.run(backend=server.endpoint(), stream=True)
    pieces = asyncio.run(collect(state))
    assert "".join(p for p, _ in pieces) == "ABCD"
    seen = 0
    for _, m in pieces:
        assert m["output_token_logprobs_length"] == m["completion_tokens"]
        assert len(m["output_token_logprobs"]) == m["completion_tokens"] - seen
        seen = m["completion_tokens"]
    assert state.get_meta_info("g")["output_token_logprobs"] == _lp(1, 2, 3, 4)
    assert all(piece for piece, _ in pieces)


def test_text_async_iter_of_a_run_without_streaming() -> None:
    server = FakeServer(lambda body: {"text": "hi", "meta_info": meta(2, 1)})

    @sgl.function
    def program(s):
        s += ">" + sgl.gen("g", max_tokens=8)

    async def collect(state, **kw):
        return [item async for item in state.text_async_iter(**kw)]

    state = program.run(backend=server.endpoint())
    assert asyncio.run(collect(state, var_name="g")) == ["hi"]
    [(text, info)] = asyncio.run(collect(state, var_name="g", return_meta_data=True))
    assert text == "hi" and info["completion_tokens"] == 1
    assert asyncio.run(collect(state)) == [">hi"] == list(state.text_iter())


def test_server_errors_surface_with_the_server_message() -> None:
    server = FakeServer(lambda body: httpx.Response(400, json={"error": "max_new_tokens too large"}))

    @sgl.function
    def program(s):
        s += sgl.gen("x")

    with pytest.raises(ServerError, match="max_new_tokens too large"):
        program.run(backend=server.endpoint())


def test_bearer_key_flush_and_server_info() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/get_server_info":
            return httpx.Response(404, json={"error": "not found"})
        return httpx.Response(200, json=MODEL_INFO if request.url.path == "/get_model_info" else {"ok": 1})

    endpoint = RuntimeEndpoint("http://sprig.test/", api_key="k", transport=httpx.MockTransport(handler))
    assert sgl.flush_cache(endpoint) is True
    assert sgl.get_server_info(endpoint) == {"ok": 1}
    assert seen == [("/get_model_info", "Bearer k"), ("/flush_cache", "Bearer k"),
                    ("/get_server_info", "Bearer k"), ("/server_info", "Bearer k")]
