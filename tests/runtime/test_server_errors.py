"""Bad input gets a 400 naming the problem, and the server keeps serving: every case is
followed by a good request and the KV integrity check."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_helpers import TIMEOUT, Server

OK = {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}
LONG_IDS = [5] * 2000


@pytest.fixture(autouse=True)
def still_serving(server: Server):
    yield
    assert server.generate(OK)["meta_info"]["completion_tokens"] >= 1
    server.wait_idle()


def sp(**params) -> dict:
    return {"text": "the cat", "sampling_params": params}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": 5}, "text"),
        ({"text": "a", "stream": 1}, "stream"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [1, "a"]}, "input_ids"),
        ({"text": "a", "sampling_params": "hot"}, "sampling_params"),
        (["not", "an", "object"], "dictionary"),
        ({"text": ""}, "text must not be empty"),
        ({"text": []}, "empty list"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[]]}, "empty prompt"),
        ({}, "exactly one"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"text": "the cat " * 800}, "context length"),
        ({"input_ids": LONG_IDS, "sampling_params": {"max_new_tokens": 1}}, "context length"),
        ({"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 100}}, "context length"),
        ({"input_ids": [1, 99999]}, "outside [0, 512)"),
        (sp(max_new_tokens=-1), "max_new_tokens"),
        (sp(max_new_tokens="ten"), "max_new_tokens"),
        (sp(n=0), "n must be"),
        (sp(temperature=-1), "temperature"),
        (sp(top_p=0), "top_p"),
        (sp(top_k=-2), "top_k"),
        (sp(min_p=2), "min_p"),
        (sp(frequency_penalty=3), "frequency_penalty"),
        (sp(repetition_penalty=0), "repetition_penalty"),
        (sp(stop=[""]), "stop"),
        (sp(bogus=1), "bogus"),
        (sp(logit_bias={str(i): 1.0 for i in range(2000)}), "logit_bias"),
        (sp(logit_bias={"99999": 1.0}), "logit_bias"),
        (sp(json_schema="{not json"), "json_schema"),
        (sp(regex="(unbalanced"), "invalid grammar"),
        (sp(regex="a", json_schema="{}"), "mutually exclusive"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params has 1 entries for 2 prompts"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "distinct"),
        ({"text": "a", "logprob_start_len": -5}, "logprob_start_len"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob has 1 entries for 2 prompts"),
        ({"text": ["a", "b"], "top_logprobs_num": [1, -1]}, "top_logprobs_num"),
        ({"text": ["a", "b"], "logprob_start_len": [0, "1"]}, "logprob_start_len"),
        ({"text": "a", "top_logprobs_num": 100000}, "top_logprobs_num must be <= 512"),
        ({"text": "a", "token_ids_logprob": [3, 99999]}, "token_ids_logprob has token ids outside [0, 512)"),
        ({"text": "a", "token_ids_logprob": list(range(300))}, "at most 256"),
        ({"text": ["a", "b"], "token_ids_logprob": [[1], [2], [3]]}, "token_ids_logprob has 3 entries for 2"),
        ({"text": "a", "token_ids_logprob": ["x"]}, "token_ids_logprob"),
        ({"text": ["a", "b"], "token_ids_logprob": [[1], 2]}, "token_ids_logprob"),
    ],
)
def test_bad_generate_input_is_a_400(server: Server, body: object, needle: str) -> None:
    r = server.post("/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"text": "\xff\xfe"}', "UTF-8"),
        (b'{"text": "\\ud800"}', "surrogate"),
        (b"", "not valid JSON"),
    ],
)
def test_undecodable_bodies_are_a_400(server: Server, content: bytes, needle: str) -> None:
    r = httpx.post(server.url + "/generate", content=content, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_client_leaving_mid_body_is_not_an_internal_error(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    before = server.log.read_text().count("unhandled error")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 4096\r\n\r\n{\"text\": \"the")
    server.generate(OK)  # the handler has run by the time a later request is answered
    assert server.log.read_text().count("unhandled error") == before, server.log.read_text()[-3000:]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": 1023}, "context length"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": [[]]}, "empty prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 10_000}, "context length"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/abort_request", {"rid": 5}, "rid"),
    ],
)
def test_bad_openai_input_is_a_400(server: Server, path: str, body: dict, needle: str) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_rid_in_flight_cannot_be_reused(server: Server) -> None:
    body = {"text": "the cat", "rid": "dup", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()  # held: dropping the iterator closes the connection (an abort)
        next(lines)
        again = server.post("/generate", {**body, "stream": False})
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        server.post("/abort_request", {"rid": "dup"})


def test_unknown_route_and_method_use_the_error_format(server: Server) -> None:
    r = server.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    wrong = server.get("/generate")
    assert wrong.json()["error"]["code"] == 405 and wrong.headers["allow"] == "POST"
