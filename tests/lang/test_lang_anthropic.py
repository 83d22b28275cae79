"""`Anthropic` (SGLang's `sgl.Anthropic`): the Messages API requests it builds and the
answers it reads (MockTransport, as Anthropic's service answers), and programs run on a
real sprig server's `/v1/messages`, whose answers equal those of the same conversation
through the `OpenAI` backend."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

import sprig as sgl
from sprig.backend.base import Prompt
from sprig.sampling import GenParams

USAGE = {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}


class FakeAnthropic:
    def __init__(self) -> None:
        self.requests: list[tuple[httpx.Request, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request, body))
        if not body.get("stream"):
            return httpx.Response(200, json={"id": "msg_1", "type": "message", "role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Par"},
                {"type": "text", "text": "is"}], "stop_reason": "end_turn", "stop_sequence": None, "usage": USAGE})
        events = [("message_start", {"message": {"id": "msg_2", "content": [], "usage": {**USAGE, "output_tokens": 1}}}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                  *[("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})
                    for t in ("Bon", "jour")],
                  ("content_block_stop", {"index": 0}),
                  ("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}),
                  ("message_stop", {})]
        text = "".join(f"event: {k}\ndata: {json.dumps({'type': k, **e})}\n\n" for k, e in events)
        return httpx.Response(200, content=text.encode())


@pytest.fixture
def fake() -> FakeAnthropic:
    return FakeAnthropic()


def backend(fake: FakeAnthropic, **kw: Any) -> sgl.Anthropic:
    return sgl.Anthropic("claude-x", base_url="http://anthropic.test", api_key="k",
                         transport=httpx.MockTransport(fake), **kw)


@sgl.function
def capital(s, country):
    s += sgl.system("Answer in one word.")
    s += sgl.user(f"What is the capital of {country}?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0, stop=["."]))


def test_a_program_becomes_a_messages_request(fake: FakeAnthropic) -> None:
    state = capital.run(country="France", backend=backend(fake))
    assert state["answer"] == "Paris"  # text blocks joined, thinking left out
    request, body = fake.requests[0]
    assert request.url.path == "/v1/messages" and request.headers["x-api-key"] == "k"
    assert request.headers["anthropic-version"] == "2023-06-01" and "authorization" not in request.headers
    assert body == {"model": "claude-x", "system": "Answer in one word.", "max_tokens": 8, "temperature": 0,
                    "stop_sequences": ["."], "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    meta = state.get_meta_info("answer")
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (9, 4, 2)
    assert meta["finish_reason"] == "end_turn"


def test_text_without_roles_prefill_schema_images_and_stream(fake: FakeAnthropic, monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "from-env")
    b = sgl.Anthropic("m", base_url="http://anthropic.test", transport=httpx.MockTransport(fake))
    b.generate(Prompt("Once upon a time"), GenParams())
    request, body = fake.requests[-1]
    assert request.headers["x-api-key"] == "from-env"
    assert body["messages"] == [{"role": "user", "content": "Once upon a time"}] and body["max_tokens"] == 128
    messages = ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                                             {"type": "text", "text": "What is it?"}]},)
    b.generate(Prompt("...", messages, "assistant", "It is a"),
               GenParams(json_schema={"type": "object"}, top_p=0.9, top_k=5))
    _, body = fake.requests[-1]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": "QUJD"}},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "It is a"}]  # the open assistant text: prefill
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert (body["top_p"], body["top_k"]) == (0.9, 5)
    chunks = list(b.generate_stream(Prompt("hi"), GenParams(max_new_tokens=2)))
    assert "".join(c.text for c in chunks) == "Bonjour" and fake.requests[-1][1]["stream"] is True
    assert chunks[-1].meta["finish_reason"] == "max_tokens" and chunks[-1].meta["completion_tokens"] == 2
    assert chunks[-1].cost.prompt_tokens == 9


@pytest.mark.parametrize(("params", "names"), [({"n": 2}, "n"), ({"regex": "[a-z]+"}, "regex"),
                                               ({"seed": 3, "min_p": 0.1}, "min_p, seed"),
                                               ({"return_logprob": True}, "return_logprob")])
def test_what_the_messages_api_cannot_take_raises(fake: FakeAnthropic, params: dict, names: str) -> None:
    with pytest.raises(ValueError, match=f"cannot take {names}"):
        backend(fake).generate(Prompt("hi"), GenParams(**params))
    with pytest.raises(NotImplementedError, match="prompt logprobs"):
        backend(fake).score_choices(Prompt("hi"), ["a", "b"], False)
    assert not fake.requests


@sgl.function
def arithmetic(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))


@sgl.function
def person(s):
    s += sgl.user("Tara Costa is 29 and lives in Oslo. Give her as JSON.")
    s += sgl.assistant(sgl.gen("json", max_tokens=48, temperature=0, json_schema=PERSON))


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_programs_on_a_sprig_server_answer_as_through_the_openai_api(demo_server) -> None:
    """The same conversations through `/v1/messages` and `/v1/chat/completions` give the
    same greedy text; streamed, the same again; a schema holds; a repeated prompt is
    served from the cache."""
    claude = sgl.Anthropic("default", base_url=demo_server.url, api_key="none")
    openai = sgl.OpenAI("default", base_url=demo_server.url + "/v1", api_key="none")
    questions = [{"question": "Ivan has 14 coins. Then Ivan buys 9 more. How many coins does Ivan have now?"},
                 {"question": "What is 6 times 7?"}]
    via_messages = [s["answer"] for s in arithmetic.run_batch(questions, backend=claude, progress_bar=False)]
    via_chat = [s["answer"] for s in arithmetic.run_batch(questions, backend=openai, progress_bar=False)]
    assert via_messages == via_chat and all(via_messages)
    streamed = arithmetic.run(**questions[0], backend=claude, stream=True)
    assert "".join(streamed.text_iter("answer")) == via_messages[0]
    again = arithmetic.run(**questions[0], backend=claude)
    assert again.get_meta_info("answer")["cached_tokens"] > 0
    jsonschema.validate(json.loads(person.run(backend=claude)["json"]), PERSON)
    demo_server.wait_idle()
