"""Errors answered in OpenAI's format on every route,
`{"error": {"message": ..., "type": ..., "param": ..., "code": <HTTP status>}}`, but
Anthropic's Messages API routes, which answer in Anthropic's,
`{"type": "error", "error": {"type": ..., "message": ...}}` (`anthropic_error_body`)."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response


class ApiError(Exception):
    """An error to answer with `status`; `param` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object (its message names the field, as ours do)."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, param: str | None = None, *, anthropic: bool = False) -> Response:
    """The error answer: OpenAI's shape, or Anthropic's (`anthropic`, on its routes)."""
    body = anthropic_error_body(status, message) if anthropic else error_body(status, message, param)
    return Response(orjson.dumps(body), status, media_type="application/json")


def parse(model: type[BaseModel], obj: Any) -> Any:
    """Validate a JSON body against `model`; a 400 `ApiError` naming the first bad field
    by its path (e.g. `messages.0.role`)."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = _path(errors[0]["loc"])
        msgs = list(dict.fromkeys(err["msg"] for err in errors if _path(err["loc"])[:1] == first[:1]))
        where = ".".join(map(str, first))
        message = f"{where + ': ' if where else ''}{'; or '.join(msgs[:3])}"
        raise ApiError(400, message, str(first[0]) if first else None) from None


def _path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location without its union-branch labels (`str`, `list[int]`,
    model class names): only field names and list indices."""
    return tuple(p for p in loc if not isinstance(p, str) or not (p[:1].isupper() or "[" in p or p in _TYPE_NAMES))


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
