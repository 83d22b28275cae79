"""What the scheduler and detokenizer processes share: logging, signals, the parent link.

Children are forked by the forkserver (`sprig.runtime.server.forkserver`). They ignore
SIGINT (a Ctrl+C reaches the whole process group; the launcher alone decides how to stop)
and exit when the launcher is gone (`ParentWatch`), so no child outlives the server even
if the launcher is killed with SIGKILL (they then remove the socket directory
themselves). Each sends a `Heartbeat` about once a second from its main loop.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import time
from multiprocessing.connection import Connection

from sprig.runtime.server.ipc import IpcPaths
from sprig.runtime.wire import StartupReport, encode

log = logging.getLogger("sprig.server")
HEARTBEAT_INTERVAL_S = 1.0
LOG_FORMAT = "[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


def release_free_heap() -> bool:
    """Give the memory malloc holds free back to the system (glibc's `malloc_trim`, which
    also releases free pages inside the heap, not only at its top). A long-running
    scheduler allocates tensors of ever-varying sizes; glibc serves many of them from a
    heap that fragments, so its RSS creeps up with the requests served (750 -> 893 MB over
    9,000 soak requests) unless the free pages are released now and then. False where
    there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def setup_child(level: str) -> None:
    setup_logging(level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ParentWatch:
    """`alive()` is False once the launcher has exited, however it exited (SIGKILL too).

    `link` is the read end of a pipe whose only write end the launcher holds and never
    writes to: it turns readable (EOF) when the launcher is gone. Not the parent pid: a
    child forked by the forkserver has the forkserver as its parent, which outlives the
    launcher as long as any child it forked runs."""

    def __init__(self, link: Connection) -> None:
        self.link = link

    def alive(self) -> bool:
        return not self.link.poll()


class HeartbeatClock:
    """`due()` is True at most once every `HEARTBEAT_INTERVAL_S` seconds."""

    def __init__(self) -> None:
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + HEARTBEAT_INTERVAL_S
        return True


def leave_orphaned(ipc: IpcPaths) -> None:
    """The launcher is gone (even SIGKILL leaves the children running until they notice):
    remove the socket directory it can no longer remove."""
    log.info("the server process is gone; exiting")
    ipc.remove()


def report_startup(conn: Connection, report: StartupReport) -> None:
    """Tell the launcher this child is ready (or why it failed); the pipe is then closed."""
    try:
        conn.send_bytes(encode(report))
    finally:
        conn.close()
