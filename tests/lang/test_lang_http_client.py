"""The frontend's shared HTTP client over real sockets: many threads at once."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sprig.backend.http import HttpClient

IN_FLIGHT = 120  # beyond httpx's default pool of 100 connections


@pytest.fixture
def all_at_once_server() -> Iterator[str]:
    """Answers a POST only once IN_FLIGHT requests are open together (500 after 60 s)."""
    barrier = threading.Barrier(IN_FLIGHT, timeout=60)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                barrier.wait()
                status, body = 200, {"ok": True}
            except threading.BrokenBarrierError:
                status, body = 500, {"error": "not every request arrived"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 2 * IN_FLIGHT  # the listen backlog: every connect lands at once

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_more_threads_than_a_default_pool_all_get_a_connection(all_at_once_server: str) -> None:
    client = HttpClient(all_at_once_server, timeout=90)
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        answers = list(pool.map(lambda _: client.post("/generate", {})[0], range(IN_FLIGHT)))
    assert answers == [{"ok": True}] * IN_FLIGHT


@pytest.fixture
def closes_after_one_answer() -> Iterator[tuple[str, list[int]]]:
    """A keep-alive HTTP/1.1 server that answers the first request on each connection
    and closes the connection, unanswered, when a second request arrives on it: the
    race of a server closing an idle connection just as the client reuses it. Yields
    its URL and the number of connections it accepted (a one-item list)."""
    sock = socket.create_server(("127.0.0.1", 0))
    accepted = [0]

    def read_request(conn: socket.socket) -> bytes | None:
        """The next request's body; None when the client closed the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        while len(body) < length:
            body += conn.recv(65536)
        return body

    def serve(conn: socket.socket) -> None:
        with conn:
            if read_request(conn) is None:
                return
            data = json.dumps({"ok": True}).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode() + data
            )
            read_request(conn)  # the reuse: read it, then hang up without an answer

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", accepted
    sock.close()


def test_a_request_on_a_connection_the_server_dropped_is_sent_again(
    closes_after_one_answer: tuple[str, list[int]],
) -> None:
    url, accepted = closes_after_one_answer
    client = HttpClient(url)
    try:
        for _ in range(5):  # every call after the first reuses a connection the server drops
            assert client.post("/generate", {"text": "hi"})[0] == {"ok": True}
        assert [event for event, _ in client.stream("/generate", {"stream": True})] == []
        assert client.get("/health") == {"ok": True}
    finally:
        client.close()
    assert accepted[0] == 7  # one fresh connection per call


def test_a_server_that_keeps_dropping_connections_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    calls = [0]

    def drop(request: httpx.Request) -> httpx.Response:
        calls[0] += 1
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    monkeypatch.setattr("sprig.backend.http.RETRY_BACKOFF_S", 0.0)
    client = HttpClient("http://server", transport=httpx.MockTransport(drop))
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/generate", {"text": "hi"})
    assert calls[0] == 3  # the call and two retries
