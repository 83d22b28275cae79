"""The forkserver's last preload module (`forkserver.CHILD_MODULES`): imported there, it
makes the forkserver leave without the interpreter's teardown once the server's process
is gone (torch's C++ registries free their memory piece by piece: about 2.5 s on 2
cores, after every child it forked has been joined). Imported anywhere else (nothing
imports it by name; the import-graph test imports every module) it does nothing.

The forkserver's exit is a `SystemExit` at its pipe's EOF, status 0, and it holds
nothing its exit handlers would release (its listener and temporary directory are the
server process's), so the handler ends it at once with that status."""

from __future__ import annotations

import atexit
import os
import sys
from multiprocessing import forkserver


def _imported_by_the_forkserver() -> bool:
    """Whether this import runs inside multiprocessing's forkserver loop (its preloads)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _imported_by_the_forkserver():
    atexit.register(os._exit, 0)
