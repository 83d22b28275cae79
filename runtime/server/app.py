"""The FastAPI application: the API-key / body-size guard, error handlers (Anthropic's
error shape on its Messages routes, OpenAI's elsewhere), the health, OpenAPI and metrics
routes, and the routers of `routes_native`, `routes_openai`, `routes_responses`,
`routes_messages`, `routes_score`, `routes_embeddings`, `routes_weights`, `routes_lora`,
`routes_worker` and `routes_info` (which share `http_io`)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sprig.runtime.server import (
    routes_embeddings,
    routes_info,
    routes_lora,
    routes_messages,
    routes_native,
    routes_openai,
    routes_responses,
    routes_score,
    routes_weights,
    routes_worker,
)
from sprig.runtime.server.errors import ApiError, error_response
from sprig.runtime.server.http_io import ServerState, json_response
from sprig.runtime.server.openapi import openapi_document
from sprig.runtime.server.request_manager import RequestFailed
from sprig.runtime.server.routes_messages import MESSAGES_PREFIX

log = logging.getLogger("sprig.server")
OPEN_PATHS = frozenset({"/health", "/metrics"})


def anthropic_path(path: str) -> bool:
    """Whether `path` is one of Anthropic's Messages routes (errors in its shape)."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


class Guard:
    """Pure ASGI middleware (streams pass untouched): the API key on every path but
    `OPEN_PATHS` (as `Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's
    clients send it), and a 413 for a declared Content-Length over the limit. A request
    that passes carries its key's index as `request.state.client` (`client_of`)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], max_bytes: int) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys]
        self.max_bytes = max_bytes

    def _client(self, headers: dict[bytes, bytes]) -> int | None:
        """The index of the key the headers carry (every key compared, in constant time)."""
        bearer = headers.get(b"authorization", b"")
        key = bearer[len(b"Bearer "):] if bearer.startswith(b"Bearer ") else headers.get(b"x-api-key", b"")
        matches = [i for i, e in enumerate(self.keys) if hmac.compare_digest(key, e)]
        return matches[0] if matches else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            client = self._client(headers)
            scope.setdefault("state", {})["client"] = client
            anthropic = anthropic_path(scope["path"])
            if self.keys and scope["path"] not in OPEN_PATHS and client is None:
                refusal = error_response(401, "missing or invalid API key (Authorization: Bearer <key>, or "
                                              "x-api-key: <key>)", anthropic=anthropic)
            length = headers.get(b"content-length", b"0")
            if refusal is None and length.isdigit() and int(length) > self.max_bytes:
                refusal = error_response(413, f"the request body exceeds {self.max_bytes} bytes", anthropic=anthropic)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.manager.start()
        log.info("sprig server ready at %s (model %s)", state.url, state.model_path)
        yield
        await state.manager.stop()

    app = FastAPI(title="sprig", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.sprig = state
    app.add_middleware(Guard, api_keys=state.config.api_keys, max_bytes=state.config.max_request_bytes)

    def answer(request: Request, status: int, message: str, param: str | None = None) -> Response:
        return error_response(status, message, param, anthropic=anthropic_path(request.url.path))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return answer(request, exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> Response:  # path and query
        first = exc.errors()[0]
        name = str(first["loc"][-1])
        return answer(request, 400, f"{name}: {first['msg']}", name)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:  # 404, 405 (with Allow)
        response = answer(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestFailed)
    async def request_failed(request: Request, exc: RequestFailed) -> Response:
        response = answer(request, exc.status, exc.message)
        if exc.status == 429:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return answer(request, 500, "internal server error (the server log has the details)")

    @app.get("/health")
    async def health(request: Request) -> Response:
        dead = state.manager.dead
        return error_response(503, dead) if dead else Response(status_code=200)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        return json_response(openapi_document(app, version("sprig"), bool(state.config.api_keys)))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(state.manager.metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(routes_native.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_score.router)
    app.include_router(routes_embeddings.router)
    app.include_router(routes_weights.router)
    app.include_router(routes_lora.router)
    app.include_router(routes_worker.router)
    app.include_router(routes_info.router)
    return app
