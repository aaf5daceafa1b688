"""Errors in the OpenAI error body shape, so clients' SDKs raise their usual exceptions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

import orjson
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


MAX_MESSAGE_CHARS = 1024  # client strings echoed in a message (a model name, an engine's verdict) stop here


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out: what a client sent is
    never echoed back (or logged) at whatever size it chose."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class APIError(Exception):
    """An error the client should see, with the HTTP status that goes with it. The message is
    clipped (``clip``): it may carry client strings."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = clip(message)
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> ErrorBody:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse_event(self) -> bytes:
        """The same error as a server-sent event, for failures after a stream has started."""
        return b"data: " + orjson.dumps(self.body()) + b"\n\n"


def error_response(err: APIError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(err.body()),
        status_code=err.status,
        media_type="application/json",
        headers={**err.headers, **(headers or {})},
    )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
