"""uvicorn's h11 protocol with a deadline on request headers, against slow clients
(slowloris): a connection whose request line and headers do not arrive in full within
`timeout` seconds of their first byte (or of the connection's opening) is closed. uvicorn
itself bounds only the idle time between keep-alive requests. The body's deadline is
`app.read_body`'s."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """Set `timeout` on a subclass (`with_header_timeout`)."""

    timeout: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request's headers are still to come
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s", self.timeout)
            self.transport.close()


def with_header_timeout(timeout: float) -> type[HeaderDeadlineProtocol]:
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"timeout": timeout})
