"""Several API keys, one a client: each key's requests are its own to abort."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_helpers import TIMEOUT, Server, parse_event, running_server

LONG = {"max_new_tokens": 600, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("alice\n\n  bob  \n")  # blank lines skipped, blanks around a key stripped
    with running_server(tiny_llama, "--api-key-file", str(keys), api_key="alice") as s:
        yield s


def test_every_key_in_the_file_is_accepted(server: Server) -> None:
    body = {"text": "the cat", "sampling_params": {"max_new_tokens": 2}}
    for key, status in (("alice", 200), ("bob", 200), ("carol", 401), ("alice bob", 401)):
        assert server.post("/generate", body, headers={"Authorization": f"Bearer {key}"}).status_code == status
    assert server.get("/get_server_info").json()["server"]["api_keys"] == 2
    server.wait_idle()


def test_a_client_aborts_only_its_own_requests(server: Server) -> None:
    bob = {"Authorization": "Bearer bob"}
    body = {"text": "the cat sat", "rid": "job", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=TIMEOUT) as r:
        lines = (line for line in r.iter_lines() if line)
        parse_event(next(lines))
        assert server.post("/abort_request", {"rid": "job"}, headers=bob).json() == {"rid": "job", "aborted": False}
        parse_event(next(lines))  # still running for its own client
        assert server.post("/abort_request", {"rid": "job"}).json() == {"rid": "job", "aborted": True}
        events = [parse_event(line) for line in lines]
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.wait_idle()["running"] == 0
