"""Relay the decode engine's answer to the client, and abort everything if the client leaves.

The response object runs the whole upstream exchange (prefill leg included) while a watcher task
waits for the client's ``http.disconnect`` and, if it comes first, cancels the exchange. That
closes the upstream connections, and vLLM aborts a request whose connection closes, so a
departed client never leaves an engine working or KV blocks held. The watcher starts only once
an exchange has run for ``WATCH_AFTER_S``: a quick answer pays no task for it, and a request
abandoned earlier is aborted that much later. Streams go out chunk by chunk, as they arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from starlette.types import Receive, Scope, Send

from .dispatch import DecodeStream
from .errors import APIError
from .h1client import ClientError
from .requestlog import RequestRecord
from .upstream import transport_error

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in metrics only
WATCH_AFTER_S = 0.02
PATH_HEADER = "x-pdgate-path"  # the path actually taken (failover may change the decided one)
FAILOVER_HEADER = "x-pdgate-failover"


@dataclass
class Outcome:
    status: int = 0
    error: str = ""
    path: str = ""  # the path really taken (failover may change the decided one); "" if none


@dataclass
class RelayResponse:
    """An ASGI response whose body comes from ``start()``, an upstream exchange yet to run."""

    start: Callable[[], Awaitable[DecodeStream]]
    stream: bool
    headers: dict[str, str]
    on_done: Callable[[Outcome], None]
    record: RequestRecord | None = None  # told when chunks go out (time to first token, ITL, usage)
    outcome: Outcome = field(default_factory=Outcome)
    _started: bool = False  # response headers have gone to the client
    _finished: bool = False  # the whole answer (an SSE stream through [DONE]) has gone to the client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = _DisconnectWatch(receive, task)
        try:
            await self._exchange(send)
        except asyncio.CancelledError:
            if not watch.left:  # the server is shutting down: not ours to swallow
                self.outcome = Outcome(503, "cancelled: the gateway is shutting down", self.outcome.path)
                raise
            task.uncancel()
            if not self._finished:  # a client that hangs up after [DONE] got its whole answer
                self.outcome = Outcome(CLIENT_CLOSED, "client disconnected", self.outcome.path)
        finally:
            watch.stop()
            self.on_done(self.outcome)

    async def _exchange(self, send: Send) -> None:
        try:
            upstream = await self.start()
        except APIError as err:
            self.outcome = Outcome(err.status, err.message)
            # No path was completed: the decided one, maybe abandoned by failover, would mislead.
            await _send_error(send, err, {k: v for k, v in self.headers.items() if k != PATH_HEADER})
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
        rec = self.record
        fields = {**self.headers, PATH_HEADER: up.path.value}
        if up.failover:
            fields[FAILOVER_HEADER] = ",".join(up.failover)
        headers = [(k.encode(), v.encode()) for k, v in fields.items()]
        headers.append((b"content-type", resp.header(b"content-type") or b"application/json"))
        if not self.stream:
            body = up.head  # the dispatcher read the whole answer before handing it over
            headers.append((b"content-length", str(len(body)).encode()))
            self._started = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            self.outcome = Outcome(resp.status, path=up.path.value)
            self._finished = True
            if rec is not None:
                rec.sent_body(body)
            return True
        self._started = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.outcome = Outcome(resp.status, path=up.path.value)
        try:
            chunk = up.head  # the first chunk, read by the dispatcher
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if rec is not None:
                    rec.sent_chunk(chunk)
                if chunk.endswith(b"data: [DONE]\n\n"):
                    self._finished = True
                chunk = await resp.read_some()
        except (TimeoutError, ClientError) as err:
            # Headers are gone already: end the stream with an error event, never a silent cut.
            cut = transport_error(err, "decode")
            self.outcome = Outcome(cut.status, cut.message, up.path.value)
            await send({"type": "http.response.body", "body": cut.sse_event(), "more_body": False})
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


class _DisconnectWatch:
    """Cancels ``task`` (the exchange, and so both upstream legs) when the client disconnects,
    watching from ``WATCH_AFTER_S`` on."""

    __slots__ = ("_receive", "_task", "_timer", "_watcher", "left")

    def __init__(self, receive: Receive, task: asyncio.Task) -> None:
        self.left = False
        self._receive = receive
        self._task = task
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.left = True
                self._task.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def _send_error(send: Send, err: APIError, headers: dict[str, str]) -> None:
    body = orjson.dumps(err.body())
    raw_headers = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw_headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
