"""What the routes share: the app's state, reading a request (body limits and timeouts,
JSON parsing, work moved off the event loop), and writing JSON and server-sent events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.json_limits import check_depth
from sprig.runtime.server.config import ServerConfig
from sprig.runtime.server.errors import ApiError, error_body
from sprig.runtime.server.harmony_call import HarmonyServing
from sprig.runtime.server.request_builder import RequestBuilder
from sprig.runtime.server.request_manager import RequestFailed, RequestManager
from sprig.runtime.server.responses_store import ResponseStore
from sprig.runtime.server.tool_calls import CallFormat

log = logging.getLogger("sprig.server")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerState:
    """What the routes need; one per app (`app.state.sprig`). `model_path` is the
    checkpoint the server started from (its tokenizer's); `manager.weights` says whose
    weights run now."""

    config: ServerConfig
    engine: EngineConfig
    model_path: str
    model_name: str
    model_info: dict[str, Any]  # the scheduler's startup report
    manager: RequestManager
    builder: RequestBuilder
    tool_format: CallFormat | None  # how chat answers hold tool calls; None: not parsed
    harmony: HarmonyServing | None  # chat answers are harmony messages (gpt-oss); then tool_format is None
    context_free: bool  # the scheduler compiles Lark grammars (llguidance drives the tokenizer)
    started: float  # time.monotonic() at launch
    url: str
    pool: ThreadPoolExecutor  # where requests are parsed, rendered and tokenized (`prepare`)
    responses: ResponseStore  # stored /v1/responses


def state_of(request: Request) -> ServerState:
    return request.app.state.sprig


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that calls `on_close` however it ends (done, client gone, error),
    so a disconnected client's sequences are aborted."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def prepare(request: Request, build: Callable[[Any], T], *, new_work: bool = True) -> T:
    """`build(body)` of the request's JSON body, run on the server's input pool: parsing,
    validation, chat rendering and tokenization never run on the event loop, and each
    builder checks sizes before it tokenizes. With `new_work`, a server already full
    answers 429 before reading the body."""
    st = state_of(request)
    if new_work:
        st.manager.check_room(1)
    body = await read_body(request)
    return await asyncio.get_running_loop().run_in_executor(st.pool, lambda: build(parse_json(body)))


async def read_body(request: Request) -> bytes:
    """The body; 413 past `max_request_bytes` (stops reading); 408 if it takes longer
    than `read_timeout`; 499 (logged at debug level, nobody reads it) if the client
    leaves before the body is complete."""
    config = state_of(request).config
    limit = config.max_request_bytes
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes")

    try:
        await asyncio.wait_for(read(), config.read_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {config.read_timeout:g} s") from None
    except ClientDisconnect:
        log.debug("client left while sending %s", request.url.path)
        raise ApiError(499, "the client disconnected before the request body was complete") from None
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """The body as JSON; 400 if it is not JSON (or not UTF-8), or nests too deeply."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    try:
        return check_depth(value, "the request body")
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def client_gone(request: Request) -> None:
    """Return once the client of `request` has disconnected. Await it only after the body
    was read: the ASGI server then answers `receive()` with nothing but
    `http.disconnect`, sent as the connection closes, so this waits on an event rather
    than polling (a client that gives up is noticed at once)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_of(request: Request) -> int | None:
    """Which API key the request came with (its index), None when the server has none."""
    return request.state.client


def error_event(exc: RequestFailed | ApiError) -> bytes:
    """An error inside an event stream (headers are already sent), before `[DONE]`."""
    return sse(error_body(exc.status, exc.message))


def now_s() -> int:
    return int(time.time())
