"""`Runtime`: start a sprig server as a subprocess and talk to it through `.endpoint`, or
through SGLang's `Runtime` methods (`generate`, `async_generate` / `add_request`, `encode`,
`get_server_info`, `get_tokenizer`), which return what SGLang's do.

The command is `<launcher> serve --model PATH --host HOST --port PORT [--flag value]...`
with `launcher = (sys.executable, "-m", "sprig.runtime")` by default; each keyword
argument `some_flag=value` becomes `--some-flag value` (`True` -> a bare `--some-flag`,
`False`/`None` -> omitted, a list -> `--some-flag a b`). The server's stdout and stderr
go to `log_path`; if it exits or stays unhealthy past `launch_timeout`, the error
carries the log's tail. The server runs in its own process group, which `shutdown`
terminates (then kills), so its worker processes go with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import httpx

from sprig.backend.http import SSE_DONE, check_response, sse_event
from sprig.backend.runtime_endpoint import RuntimeEndpoint

DEFAULT_LAUNCHER = (sys.executable, "-m", "sprig.runtime")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(
    model_path: str, host: str, port: int, launcher: Sequence[str] = DEFAULT_LAUNCHER, **server_args: Any
) -> list[str]:
    """The argv that starts a server (see the module docstring)."""
    argv = [*launcher, "serve", "--model", str(model_path), "--host", host, "--port", str(port)]
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


class Runtime:
    """A server process plus a `RuntimeEndpoint` to it; usable as a context manager.

    Invariant: once the constructor returns, `/health` has answered 200 and `.endpoint`
    is connected; on any failure the process is already gone.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        launch_timeout: float = 300.0,
        launcher: Sequence[str] = DEFAULT_LAUNCHER,
        api_key: str | None = None,
        **server_args: Any,
    ) -> None:
        if model_path is None:  # sprig's embedded demo model
            from sprig.runtime.demo import ensure_demo_model

            model_path = str(ensure_demo_model())
        self.model_path = str(model_path)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.command = server_command(model_path, host, self.port, launcher, **server_args)
        log = tempfile.NamedTemporaryFile(prefix="sprig-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = log.name
        env = os.environ | ({"SPRIG_API_KEY": api_key} if api_key else {})  # not on argv, where `ps` shows it
        process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
        log.close()
        self._process: subprocess.Popen[bytes] | None = process
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(process, launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"the server exited with code {code} before it was healthy:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise TimeoutError(f"the server was not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines the server wrote (stdout and stderr)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no server log)"

    def shutdown(self) -> None:
        """Stop the server and its process group; idempotent."""
        process, self._process = self._process, None
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.close()
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown()

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    # ------------------------------------------------------------------ SGLang's `Runtime` calls
    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None) -> str:
        """One `/generate` call; its response (one prompt's, or a list for a batch) as JSON
        text, as SGLang's `Runtime.generate` returns it. An error answer raises `ServerError`."""
        payload = {"text": prompt, "sampling_params": sampling_params, "return_logprob": return_logprob,
                   "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        return json.dumps(self.endpoint.http.post("/generate", _given(payload))[0])

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """A streamed `/generate` of one prompt, yielding each piece of new text as it comes
        (SGLang's `Runtime.async_generate`, also named `add_request`). An error answer, or
        an error event mid-stream, raises `ServerError`."""
        payload = _given({"text": prompt, "sampling_params": sampling_params, "stream": True})
        sent = 0
        async with (httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=None) as client,
                    client.stream("POST", "/generate", json=payload) as response):
            if response.status_code >= 400:
                await response.aread()
                check_response("/generate", response)
            async for line in response.aiter_lines():
                event = sse_event("/generate", response.status_code, line)
                if event is SSE_DONE:
                    return
                if event is None:
                    continue
                piece = event["text"][sent:]
                sent = len(event["text"])
                if piece:
                    yield piece

    add_request = async_generate

    def encode(self, prompt: str | list[str]) -> str:
        """One `/encode` call (embeddings); its response as JSON text, as SGLang's
        `Runtime.encode` returns it."""
        return json.dumps(self.endpoint.http.post("/encode", {"text": prompt})[0])

    async def get_server_info(self) -> dict[str, Any]:
        """`/get_server_info`, awaited as SGLang's `Runtime.get_server_info` is."""
        async with httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=60.0) as client:
            response = await client.get("/get_server_info")
        check_response("/get_server_info", response)
        return response.json()

    def get_tokenizer(self) -> Any:
        """The served model's tokenizer, loaded in this process (transformers')."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)


def _given(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` without the fields left at None (the server's defaults apply)."""
    return {k: v for k, v in payload.items() if v is not None}
