"""schemathesis against the served OpenAPI document: generated requests to every route
(bounded examples, a fixed seed; `/pause_generation` aside, after which every generating
request waits for `/continue_generation`, and the weight-update group routes, which would
wait for a trainer) never get a 5xx, and the server is healthy and its KV
accounting exact afterwards.

The server runs with a context of 256 tokens: generated bodies ask for any number of
tokens, and the tiny model seldom stops, so on the default context of 1,024 most of the
run was decoding (13,752 tokens, 82 s alone; 5,372 tokens and 42 s at 256)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Server, running_server

EXAMPLES = 25


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    with running_server(tiny_llama, "--context-length", "256") as s:
        yield s


def test_no_generated_request_gets_a_server_error(server: Server, tmp_path: Path) -> None:
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if cli is None:
        pytest.fail("schemathesis is a dev dependency: pip install -e '.[dev]'")
    run = subprocess.run(
        [cli, "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--phases", "fuzzing",
         "-n", str(EXAMPLES), "--workers", "1", "--request-timeout", "60", "--seed", "7",
         "--report-dir", str(tmp_path), "--exclude-path", "/pause_generation",  # it would hold every later request
         # these would make the server wait (up to minutes) for a trainer at the address a body names
         "--exclude-path", "/init_weights_update_group", "--exclude-path", "/update_weights_from_distributed",
         "--exclude-path", "/destroy_weights_update_group"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout
    assert server.get("/health").status_code == 200
    server.wait_idle()
