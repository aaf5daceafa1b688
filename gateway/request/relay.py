"""The client's side of an exchange: the ASGI endpoint that drives it, and the wire its answer goes
out on.

``InferenceEndpoint`` is what the Starlette route table holds for the two inference routes: it
builds the request's ``Exchange`` (gateway/request/exchange.py) and runs it with a ``ClientWire``. Once the
body is read, the wire watches for the client's ``http.disconnect`` and, if it comes first,
cancels the exchange: that closes the upstream connections, and vLLM aborts a request whose
connection closes, so a departed client never leaves an engine working or KV blocks held. The
watch starts only once an exchange has run for ``WATCH_AFTER_S``: a quick answer pays no task for
it, and a request abandoned earlier is aborted that much later.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from gateway.http.errors import APIError
from gateway.http.splice import BodyWriter, body_writer
from gateway.request.protocol import Kind

if TYPE_CHECKING:
    from gateway.http.handlers import Gateway

WATCH_AFTER_S = 0.02
DONE = b"data: [DONE]\n\n"

Headers = list[tuple[bytes, bytes]]


class InferenceEndpoint:
    """The ASGI app of ``POST /v1/chat/completions`` or ``POST /v1/completions``."""

    def __init__(self, kind: Kind, path: str) -> None:
        self.kind = kind
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw: Gateway = scope["state"]["gw"]
        exchange = gw.exchange(Request(scope, receive), self.kind, self.path)
        wire = ClientWire(send, receive)
        try:
            await exchange.run(wire)
        except asyncio.CancelledError:
            if not wire.gone:  # the server is stopping: not ours to swallow
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the client hung up: the exchange has recorded it, nothing to answer
        finally:
            wire.stop()


class ClientWire:
    """Sends the response; ``watch`` turns a client hang-up into a cancellation of the exchange."""

    __slots__ = ("_receive", "_send", "_task", "_timer", "_watcher", "gone", "started")

    def __init__(self, send: Send, receive: Receive) -> None:
        self._send = send
        self._receive = receive
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.gone = False  # the client disconnected
        self.started = False  # response headers have gone out

    # -- the client leaving ---------------------------------------------------------------------------

    def watch(self) -> None:
        """From now on (the request body is read: nothing else reads ``receive``), a disconnect
        cancels the task running the exchange."""
        self._task = asyncio.current_task()
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start_watch)

    def _start_watch(self) -> None:
        self._timer = None
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if self._task is not None:
                    self._task.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    # -- the answer ------------------------------------------------------------------------------------

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """A complete response in one go."""
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())],
            }
        )
        await self._send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def send(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    def body_writer(self) -> BodyWriter | None:
        """A direct writer for the body of the response under way, where the server offers one
        (gateway/http/splice.py): the caller writes through it until it ends the response."""
        return body_writer()

    @property
    def asgi_send(self) -> Send:
        """The server's own ``send``, for a relay loop that would rather not pay ``send``'s extra
        call per chunk (~0.5 us each)."""
        return self._send

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def error(self, err: APIError, headers: Headers) -> None:
        """``err`` in the OpenAI shape: the whole response if nothing went out yet, else (a stream
        under way) an error event and ``[DONE]``, as vLLM ends a stream that fails."""
        if not self.started:
            fields = [
                *headers,
                *((k.lower().encode(), v.encode()) for k, v in err.headers.items()),
                (b"content-type", b"application/json"),
            ]
            await self.whole(err.status, fields, orjson.dumps(err.body()))
            return
        await self._send({"type": "http.response.body", "body": err.sse_event() + DONE, "more_body": False})
