"""A small HTTP client for model servers: JSON calls, server-sent-event streams, errors
that name the endpoint and carry the server's message. Safe to share across threads
(one `httpx.Client`, whose connection pool is thread-safe)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx

# No cap on open connections: `run_batch` threads times `fork` branches can exceed
# httpx's default of 100, and a capped pool makes the excess wait silently for a
# connection. The server bounds its own queue and answers 503 past it.
CONNECTION_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)

# A kept-alive connection the server closed just as a request went out fails with one of
# these before any answer arrives (the server never read the request, or dropped it).
# Such a request is sent again on a fresh connection, up to RETRIES more times.
DROPPED_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)
RETRIES = 2
RETRY_BACKOFF_S = 0.05

class ServerError(RuntimeError):
    """A model server answered with an error status (or an error event in a stream)."""

    def __init__(self, endpoint: str, status: int, message: str) -> None:
        super().__init__(f"{endpoint} failed with HTTP {status}: {message}")
        self.endpoint, self.status, self.message = endpoint, status, message


class HttpClient:
    """JSON over HTTP to one server. `transport` replaces the network (tests pass an
    `httpx.MockTransport`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float | None = 600.0,
        transport: httpx.BaseTransport | None = None,
        verify: bool | str = True,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`api_key` goes as `Authorization: Bearer`; `headers` are sent with every request."""
        headers = {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), **(headers or {})}
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=verify,
            limits=CONNECTION_LIMITS,
        )

    def get(self, path: str) -> Any:
        response = self._send("GET", path, None)
        check_response(path, response)
        return response.json()

    def post(self, path: str, payload: dict[str, Any]) -> tuple[Any, float]:
        """The decoded JSON answer and the seconds the call took (retries included)."""
        start = time.perf_counter()
        response = self._send("POST", path, payload)
        check_response(path, response)
        return response.json(), time.perf_counter() - start

    def stream(self, path: str, payload: dict[str, Any]) -> Iterator[tuple[dict[str, Any], float]]:
        """The `data:` events of an SSE answer until `[DONE]`, each with the seconds
        since the request began. A connection dropped before the answer began is retried
        like `post`; once events flow, a failure is raised."""
        start = time.perf_counter()
        response = self._send("POST", path, payload, stream=True)
        try:
            if response.status_code >= 400:
                response.read()
            check_response(path, response)
            for line in response.iter_lines():
                event = sse_event(path, response.status_code, line)
                if event is SSE_DONE:
                    return
                if event is not None:
                    yield event, time.perf_counter() - start
        finally:
            response.close()

    def _send(
        self, method: str, path: str, payload: dict[str, Any] | None, *, stream: bool = False
    ) -> httpx.Response:
        """Send one request; `DROPPED_CONNECTION` errors are retried on a fresh connection
        (the pool drops a failed one), after a short pause, `RETRIES` times at most."""
        attempt = 0
        while True:
            request = self._client.build_request(method, path, json=payload)
            try:
                return self._client.send(request, stream=stream)
            except DROPPED_CONNECTION:
                if attempt == RETRIES:
                    raise
                attempt += 1
                time.sleep(RETRY_BACKOFF_S * attempt)

    def close(self) -> None:
        self._client.close()


SSE_DONE = object()  # what `sse_event` returns for the stream's `[DONE]`


def sse_event(path: str, status: int, line: str) -> Any:
    """The JSON event one line of a server-sent-event answer from `path` carries: None for
    a line that is not `data:`, `SSE_DONE` for `[DONE]`. An error event raises `ServerError`."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return SSE_DONE
    event = json.loads(data)
    if isinstance(event, dict) and "error" in event:
        raise ServerError(path, status, str(event["error"]))
    return event


def check_response(path: str, response: httpx.Response) -> None:
    """Raise `ServerError` with the server's message if `response` (read) is an error."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
        message = body.get("error", body) if isinstance(body, dict) else body
    except ValueError:
        message = response.text
    raise ServerError(path, response.status_code, str(message))
