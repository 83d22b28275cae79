"""A stand-in for `python -m sprig.runtime serve ...` in the `Runtime` tests: answers
`/health`, `/get_model_info` and `/generate` (echoing the prompt's length)."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _reply(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply({})
        elif self.path == "/get_model_info":
            self._reply({"model_path": self.server.model_path})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text = payload["text"]
        self._reply({"text": f"[{len(text)}]", "meta_info": {"prompt_tokens": len(text), "completion_tokens": 1}})

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.model_path = args.model
    server.serve_forever()


if __name__ == "__main__":
    main()
