"""Grammar compile worker processes, killed when a compile runs too long, and capped in
memory (RLIMIT_AS) so a grammar that explodes (outlines-core's regex for nested arrays
doubles per level) dies alone instead of taking the host down.

The worker runs `main(READ_FD, WRITE_FD, MEM_BYTES)` of this module in a fresh interpreter:
it reads a pickled `GrammarBackend` once, answers b"ready", then compiles each pickled
`GrammarSpec` it receives and replies with a pickled ("ok", compiled grammar) or
("invalid" | "error", message). It exits when the parent closes the pipe, so it never
outlives the server. Pickle is safe here: both ends are this program, over private pipes.
It imports no torch, so it starts in a fraction of a second.
"""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
from multiprocessing.connection import Connection

from sprig.runtime.constrained.base import CompiledGrammar, GrammarSpec, GrammarTimeoutError

_STARTUP_TIMEOUT_S = 60.0


def serve(inbox: Connection, outbox: Connection, memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    backend = pickle.loads(inbox.recv_bytes())
    outbox.send_bytes(b"ready")
    while True:
        try:
            spec = pickle.loads(inbox.recv_bytes())
        except EOFError:
            return
        try:
            reply: tuple[str, object] = ("ok", backend.compile(spec))
        except ValueError as e:
            reply = ("invalid", str(e))
        except MemoryError:
            outbox.send_bytes(pickle.dumps(("invalid", "compiling it ran out of memory")))
            return  # a fresh worker replaces this one
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        except BaseException as e:  # a Rust panic surfaces as pyo3's PanicException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            reply = ("error", f"{type(e).__name__}: {e}")
        outbox.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        del reply


class CompileWorker:
    """The parent's handle on one worker process; used by one thread at a time."""

    def __init__(self, backend_payload: bytes, memory_bytes: int) -> None:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        entry = f"from {__name__} import main; main({to_child_r}, {to_parent_w}, {memory_bytes})"
        self._proc = subprocess.Popen([sys.executable, "-c", entry], pass_fds=(to_child_r, to_parent_w))
        os.close(to_child_r)
        os.close(to_parent_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(to_parent_r, writable=False)
        try:
            self._send.send_bytes(backend_payload)
            ready = self._recv.poll(_STARTUP_TIMEOUT_S) and self._recv.recv_bytes() == b"ready"
        except (OSError, EOFError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError("grammar compile worker failed to start")

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def compile(self, spec: GrammarSpec, timeout_s: float) -> tuple[CompiledGrammar, int]:
        """The compiled grammar and the size of its pickled form. Raises `ValueError` for
        an invalid spec or one whose compile killed the worker (out of memory),
        `GrammarTimeoutError` (after killing the worker) past `timeout_s`, `RuntimeError`
        if the compile failed otherwise."""
        try:
            self._send.send_bytes(pickle.dumps(spec))
            done = self._recv.poll(timeout_s)
            data = self._recv.recv_bytes() if done else b""
        except (OSError, EOFError):
            self.kill()
            raise ValueError(
                f"compiling the {spec.kind} grammar killed its worker (out of memory?)"
            ) from None
        if not done:
            self.kill()
            raise GrammarTimeoutError(
                f"compiling the {spec.kind} grammar took longer than {timeout_s:g} s"
            )
        status, value = pickle.loads(data)
        if status == "invalid":
            raise ValueError(value)
        if status == "error":
            raise RuntimeError(f"grammar compile failed: {value}")
        return value, len(data)

    def kill(self) -> None:
        if self.alive:
            self._proc.kill()
        self._proc.wait()
        self._send.close()
        self._recv.close()


def main(read_fd: int, write_fd: int, memory_bytes: int) -> None:
    """The worker process's entry point."""
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False), memory_bytes)
