"""Relay the decode engine's answer to the client, and abort everything if the client leaves.

The response object runs the whole upstream exchange (prefill leg included) while a watcher task
waits for the client's ``http.disconnect`` and, if it comes first, cancels the exchange. That
closes the upstream connections, and vLLM aborts a request whose connection closes, so a
departed client never leaves an engine working or KV blocks held. Streams go out chunk by chunk,
as they arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from starlette.types import Receive, Scope, Send

from .dispatch import DecodeStream
from .errors import APIError
from .upstream import transport_error

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only


@dataclass
class Outcome:
    status: int = 0
    error: str = ""


@dataclass
class RelayResponse:
    """An ASGI response whose body comes from ``start()``, an upstream exchange yet to run."""

    start: Callable[[], Awaitable[DecodeStream]]
    stream: bool
    headers: dict[str, str]
    on_done: Callable[[Outcome], None]
    outcome: Outcome = field(default_factory=Outcome)
    _started: bool = False  # response headers have gone to the client
    _finished: bool = False  # the whole answer (an SSE stream through [DONE]) has gone to the client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        left = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, task, left))
        try:
            await self._exchange(send)
        except asyncio.CancelledError:
            if not left.is_set():
                raise  # the server is shutting down: not ours to swallow
            task.uncancel()
            if not self._finished:  # a client that hangs up after [DONE] got its whole answer
                self.outcome = Outcome(CLIENT_CLOSED, "client disconnected")
        finally:
            watcher.cancel()
            self.on_done(self.outcome)

    async def _exchange(self, send: Send) -> None:
        try:
            upstream = await self.start()
        except APIError as err:
            self.outcome = Outcome(err.status, err.message)
            await _send_error(send, err, self.headers)
            return
        except Exception:
            log.exception("upstream exchange failed")
            await self._internal_error(send)
            return
        clean = False
        try:
            clean = await self._relay(upstream, send)
        except Exception:
            log.exception("relaying the decode answer failed")
            await self._internal_error(send)
        finally:
            upstream.close(reuse=clean)

    async def _internal_error(self, send: Send) -> None:
        """A bug, not the client's or an engine's doing: still an OpenAI-shaped answer, never a hang."""
        err = APIError(500, "The gateway failed to handle this request.", code="internal_error")
        self.outcome = Outcome(500, err.message)
        if not self._started:
            await _send_error(send, err, self.headers)
        elif self.stream:
            await send({"type": "http.response.body", "body": err.sse_event(), "more_body": False})

    async def _relay(self, up: DecodeStream, send: Send) -> bool:
        """Send the engine's answer on; True when it arrived whole (the connection is reusable)."""
        resp = up.resp
        headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        headers.append((b"content-type", resp.headers.get("Content-Type", "application/json").encode()))
        if not self.stream:
            try:
                body = await resp.read()
            except (TimeoutError, aiohttp.ClientError) as err:
                failed = transport_error(err, "decode")
                self.outcome = Outcome(502, failed.message)
                await _send_error(send, failed, self.headers)
                return False
            headers.append((b"content-length", str(len(body)).encode()))
            self._started = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            self.outcome = Outcome(resp.status)
            self._finished = True
            return True
        self._started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.outcome = Outcome(resp.status)
        try:
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if chunk.endswith(b"data: [DONE]\n\n"):
                    self._finished = True
        except (TimeoutError, aiohttp.ClientError) as err:
            # Headers are gone already: end the stream with an error event, never a silent cut.
            cut = transport_error(err, "decode")
            self.outcome = Outcome(cut.status, cut.message)
            await send({"type": "http.response.body", "body": cut.sse_event(), "more_body": False})
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


async def _watch_disconnect(receive: Receive, task: asyncio.Task, left: asyncio.Event) -> None:
    """Cancel ``task`` (the exchange, and so both upstream legs) when the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            left.set()
            task.cancel()
            return


async def _send_error(send: Send, err: APIError, headers: dict[str, str]) -> None:
    body = orjson.dumps(err.body())
    raw_headers = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw_headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
