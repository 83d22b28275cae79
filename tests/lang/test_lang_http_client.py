"""The frontend's shared HTTP client over real sockets: many threads at once."""

from __future__ import annotations

import json
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
