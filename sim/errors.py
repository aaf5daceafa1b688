"""vLLM's error shapes: :class:`ApiError` (its ``ErrorResponse`` body, as JSON or as a stream's
error event) and the constructors for the errors vLLM's layers raise (request-schema errors,
validation errors, a body that is not JSON), plus the two errors the engine answers with.

Kept apart from the request checks (:mod:`sim.parsing`) and the response shapes
(:mod:`sim.responses`) because every layer of the app raises or sends these: the checks, the
generation routes, the render routes and the fault plan.
"""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    """An error answered as vLLM's ErrorResponse: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
        *,
        late: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param
        # "late": raised by the engine after a stream would have started (HTTP 200 + an
        # error event in streaming mode, like vLLM's input-processor checks).
        self.late = late

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}

    def sse(self) -> bytes:
        # vLLM serializes stream errors with json.dumps (spaces after separators).
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """vLLM's VLLMValidationError: 400 BadRequestError, '(parameter=..., value=...)' appended."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return ApiError(text, 400, "BadRequestError", parameter)


def schema_error(msg: str, loc: str = "body", param: str | None = None) -> ApiError:
    """What FastAPI/pydantic request validation turns into in vLLM (type 'Bad Request')."""
    text = f"1 validation error:\n  {{'type': 'value_error', 'loc': '{loc}', 'msg': {msg!r}}}"
    return ApiError(text, 400, "Bad Request", param if param is not None else loc)


def parse_json_like_fastapi(raw: bytes) -> Any:
    """The slow path after orjson refused a body: Python's json (what FastAPI uses) either
    accepts it (NaN, Infinity) or gives the error vLLM reports."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = getattr(e, "pos", 0)
        msg = getattr(e, "msg", str(e))
        raise ApiError(
            f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', 'msg': 'JSON decode error', "
            f"'input': '<dict of 0 items>', 'ctx': {{'error': {msg!r}}}}}",
            400,
            "Bad Request",
            f"body.{pos}",
        ) from e


def not_supported(name: str) -> ApiError:
    return ApiError(f"sim: `{name}` is not supported by the simulator", 400, "BadRequestError", name)


INTERNAL_ERROR = ApiError("Internal server error", 500, "InternalServerError")  # vLLM's GenerationError
RETRYABLE_ERROR = ApiError("Request failed; please retry", 503, "ServiceUnavailableError")  # RetryableRequestError
