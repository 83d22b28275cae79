"""The end-to-end server shared by the server test modules: starting one costs seconds
(three processes each load torch and transformers), so it is started once per session,
on first use. Tests that break or stop a server start their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Server, running_server


@pytest.fixture(scope="session")
def server(tiny_llama: Path) -> Iterator[Server]:
    with running_server(tiny_llama) as s:
        yield s
