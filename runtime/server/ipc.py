"""The server's ZeroMQ endpoints: `ipc://` sockets in a directory private to one server.

Each process binds the one PULL socket it reads from and connects PUSH sockets to its
peers' (ZeroMQ queues messages until a peer's bind appears, so start order is free).
The directory is created with mode 0700 by `tempfile.mkdtemp`, so two servers never
share a socket file and other users cannot connect; the launcher removes it on exit.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq


@dataclass(frozen=True)
class IpcPaths:
    """The socket addresses of one server, all inside `dir`."""

    dir: str

    @classmethod
    def create(cls) -> IpcPaths:
        return cls(tempfile.mkdtemp(prefix="sprig-"))

    def _addr(self, name: str) -> str:
        return f"ipc://{Path(self.dir) / name}"

    @property
    def scheduler(self) -> str:
        """Read by the scheduler: TokenizedRequest, AbortReq, ControlReq."""
        return self._addr("scheduler")

    @property
    def detokenizer(self) -> str:
        """Read by the detokenizer: DetokRegister, TokenBatch, Forget."""
        return self._addr("detokenizer")

    @property
    def http(self) -> str:
        """Read by the HTTP process: DetokenizedBatch, RequestError, StatsReport, ControlReply."""
        return self._addr("http")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str, *, unbounded: bool = False) -> zmq.Socket:
    """A PUSH socket to `addr`. `unbounded`: no send high-water mark, so a send never
    fails or waits (the sender must bound what it queues itself)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if unbounded:
        sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(addr)
    return sock
