"""ASGI plumbing shared by the simulator's routes: the raw ASGI types, a header lookup, and JSON
responses sent raw (the generation routes) or through Starlette (the others).

The generation routes are raw ASGI callables (:mod:`sim.generate`, :mod:`sim.streaming`) so that
they can watch for ``http.disconnect``; the other routes are Starlette endpoints (:mod:`sim.app`,
:mod:`sim.controls`). Both answer JSON the same way, with orjson.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from starlette.background import BackgroundTask
from starlette.responses import Response

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON_CT = (b"content-type", b"application/json")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


async def send_json(send: Send, status: int, obj: Any) -> None:
    data = orjson.dumps(obj)
    headers = [(b"content-length", str(len(data)).encode()), _JSON_CT]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def json_response(obj: Any, status: int = 200, background: BackgroundTask | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", background=background)


def header(scope: Scope, name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]  # ASGI: (name, value) byte pairs
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None
