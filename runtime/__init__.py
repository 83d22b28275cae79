"""sprig.runtime: the serving side — model runner, scheduler, sampling, engine and server."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sprig.runtime.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from sprig.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'sprig.runtime' has no attribute {name!r}")
