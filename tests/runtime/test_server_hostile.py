"""What an adversarial client sends cannot freeze the server, crash a route, leak a path or
an exception, or leave work running: each case names the hole it closes, and after each
the server answers /health at once and the KV accounting is exact."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import TIMEOUT, Server

OK = {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(autouse=True)
def still_serving(server: Server):
    yield
    assert server.generate(OK)["meta_info"]["completion_tokens"] >= 1
    server.wait_idle()


def nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


class Ticker:
    """Polls /health in the background; `worst` is the slowest answer it saw."""

    def __init__(self, server: Server) -> None:
        self.server, self.worst, self._stop = server, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            assert self.server.get("/health").status_code == 200
            self.worst = max(self.worst, time.monotonic() - start)
            time.sleep(0.02)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("key", ["chat_template", "messages", "tools", "add_generation_prompt", "bos_token"])
def test_chat_template_kwargs_cannot_replace_the_template_or_its_inputs(server: Server, key: str) -> None:
    """A client once passed its own Jinja template here; a loop in one held every route."""
    evil = "{% for i in range(10**9) %}x{% endfor %}"
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {key: evil}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert key in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template_as_variables(server: Server) -> None:
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- size before work


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server: Server) -> None:
    """30 MB of text once blocked every client for 51 s while it was tokenized on the
    event loop; now it is refused by its length, and /health answers throughout."""
    huge = "the cat sat on the mat " * 1_200_000  # ~27 MB, under the 32 MiB body limit
    with Ticker(server) as ticker:
        r = httpx.post(server.url + "/generate", json={"text": huge}, timeout=TIMEOUT)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert ticker.worst < 5.0  # a liveness bound (not a speed claim): the loop was never held


def test_a_long_id_list_is_refused_by_its_length(server: Server) -> None:
    r = server.post("/generate", {"input_ids": [5] * 500_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"


# ---------------------------------------------------------------- nesting


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "a", "sampling_params": {"json_schema": nested(500, {})}}),
        ("/generate", {"text": "a", "sampling_params": {"json_schema": '{"a":' * 5000 + "1" + "}" * 5000}}),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": nested(500, {})}}}),
        ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]}),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": nested(300, {})}}], "tool_choice": "required"}),
        ("/generate", {"text": nested(900)}),
    ],
    ids=["schema-object", "schema-string", "response-format", "tool-arguments", "tool-parameters", "body"],
)
def test_deeply_nested_input_is_a_400_without_internals(server: Server, path: str, body: dict) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Traceback" not in message and "RecursionError" not in message


# ---------------------------------------------------------------- back-pressure


def test_a_batch_past_the_bound_is_refused_whole_and_runs_nothing(server: Server) -> None:
    """~2,000 sequences in one call once got a false 503 while they kept running for
    nobody. A call is admitted whole or refused whole: past the bound it is a 400 and
    nothing runs."""
    bound = server.info()["scheduler"]["max_queued_requests"]
    prompts = ["the cat"] * (bound // 128 + 1)  # x n = 128: past the bound
    r = server.post("/generate", {"text": prompts, "sampling_params": {"n": 128, "max_new_tokens": 64}})
    assert r.status_code == 400 and f"at most {bound}" in r.json()["error"]["message"]
    state = server.wait_idle()
    assert state["running"] == state["waiting"] == 0


def test_a_big_batch_within_the_bound_is_served_whole(server: Server) -> None:
    outs = server.generate({"text": ["a b"] * 300, "sampling_params": {"max_new_tokens": 1}})
    assert len(outs) == 300 and all(o["meta_info"]["finish_reason"] is not None for o in outs)


# ---------------------------------------------------------------- slow clients


def test_a_client_that_never_finishes_its_headers_is_cut_off(tiny_llama) -> None:
    from server_helpers import running_server

    with running_server(tiny_llama, "--read-timeout", "1") as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            assert sock.recv(1024) == b""  # closed by the server
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            reply = sock.recv(4096)
        assert b" 408 " in reply.split(b"\r\n")[0]
        assert server.get("/health").status_code == 200


# ---------------------------------------------------------------- request ids, errors, paths


def test_server_request_ids_cannot_be_guessed(server: Server) -> None:
    ids = {server.generate(OK)["meta_info"]["id"] for _ in range(3)}
    assert all(len(i) == 32 for i in ids) and len(ids) == 3  # uuid4 hex, no counter


def test_concurrent_clients_get_answers_not_errors(server: Server) -> None:
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: server.post("/generate", OK).status_code, range(24)))
    assert set(statuses) == {200}


def test_the_openapi_document_describes_every_body(server: Server) -> None:
    doc = server.get("/openapi.json").json()
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/abort_request"):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    assert "/health" in doc["paths"] and "429" in doc["paths"]["/generate"]["post"]["responses"]


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_clients_that_leave_are_counted_as_finished(server: Server) -> None:
    """requests_finished used to fall behind requests_received for every client that
    disconnected mid-stream."""
    body = {"text": "the cat", "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=TIMEOUT) as r:
            next(line for line in r.iter_lines() if line)  # one event, then hang up
    server.wait_idle()
    metrics = server.get("/metrics").text
    assert _counter(metrics, "sprig_requests_finished_total") == _counter(metrics, "sprig_requests_received_total")
