"""Who may call the gateway: client API keys on the OpenAI routes, the admin token on admin routes."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

from gateway.http.errors import APIError


def _bearer(request: Request) -> bytes:
    given = request.headers.get("authorization", "")
    return given[7:].strip().encode() if given[:7].lower() == "bearer " else b""


def authorize(request: Request, api_keys: Sequence[bytes], max_header_bytes: int) -> int | None:
    """The index of the request's API key (None when keys are off). Raises 431 for oversized
    headers, 401 without a valid API key (when keys are configured)."""
    if sum(len(k) + len(v) for k, v in request.scope["headers"]) > max_header_bytes:
        raise APIError(431, f"Request headers exceed {max_header_bytes} bytes.", code="headers_too_large")
    if not api_keys:
        return None
    token = _bearer(request)
    # Compare with every key, without stopping at a match: the time taken says nothing.
    found = -1
    for i, key in enumerate(api_keys):
        if hmac.compare_digest(token, key):
            found = i
    if found < 0:
        raise APIError(401, "Incorrect API key provided.", type_="invalid_request_error", code="invalid_api_key")
    return found


def authorize_admin(request: Request, token: str) -> None:
    """Raises 401 unless the request carries ``token`` as its bearer token (``Authorization:
    Bearer <token>``, the scheme in any case, as for API keys)."""
    if not hmac.compare_digest(_bearer(request), token.encode()):
        raise APIError(
            401, "A valid admin bearer token is required.", type_="authentication_error", code="invalid_admin_token"
        )
