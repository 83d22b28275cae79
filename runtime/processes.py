"""Small process helpers shared by the launchers (the gateway's supervisor, tensor-parallel
ranks, the server's process): a free port, dying with one's parent, and exiting at once."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
from typing import NoReturn


def free_port(host: str) -> int:
    """A port free on `host` now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent(parent: int) -> None:
    """Linux: have the kernel send SIGTERM to this process when `parent` (its parent now, or
    until a moment ago) exits, however it exits (SIGKILL included); exit at once if it
    already has. A no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(1)


def exit_now(code: int) -> NoReturn:
    """End this process with `code` after its exit handlers (logging's, multiprocessing's,
    which remove its temporary directory), but without the rest of the interpreter's
    teardown, in which torch's C++ registries free their memory piece by piece (seconds on
    2 cores). For a process that has stopped everything it started."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
