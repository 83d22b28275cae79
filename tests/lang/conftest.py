"""Fixtures for the language tests: a scripted backend and a clean default backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scripted_backend import ScriptedBackend

from sprig.backend import base


@pytest.fixture(autouse=True)
def _no_default_backend() -> Iterator[None]:
    base.set_default_backend(None)
    yield
    base.set_default_backend(None)


@pytest.fixture
def echo_backend() -> ScriptedBackend:
    """Answers every gen with `<N>` where N counts the gens so far."""
    counter = iter(range(10_000))
    return ScriptedBackend(lambda text, params: f"<{next(counter)}>")
