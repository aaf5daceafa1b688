"""The engine legs' HTTP client on aiohttp: the reference ``EngineTransport``.

It exists so that the hand-written ``H1Client`` is measured against a well-kept library: both
pass one conformance suite (tests/gateway/test_transport.py), and ``engines.transport: aiohttp``
swaps it in if ``H1Client`` is ever suspected. It costs about five times H1Client's CPU per
request (docs/benchmarks.md, "Upstream HTTP client").

aiohttp does the HTTP; this module maps it onto the interface: one ``ClientSession`` whose
connector keeps a keep-alive pool per engine (host, port, TLS), ``Timeouts`` with the same
meaning as ``H1Client``'s (``connect`` through aiohttp's own, the others through one
``asyncio.timeout`` per wait, so that ``idle`` counts from the start of each wait and ``first``
spans calls), the response head bounded by the same limits, and aiohttp's exceptions turned
into the interface's.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, TypedDict

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from gateway.engines.transport import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    BodySink,
    ClientError,
    ConnectError,
    FirstTimeout,
    HeadTooLarge,
    ProtocolError,
    ServerDisconnected,
    Timeouts,
    read_whole,
    splice_by_reading,
)

# Headers aiohttp would add on its own: the engines get what H1Client sends (Host, the caller's
# headers, Content-Length), and nothing asks for compressed bodies the relay could not pass on.
_SKIP_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


class _HeadLimits(TypedDict, total=False):
    """aiohttp.ClientSession's bounds on a response head."""

    max_line_size: int
    max_field_size: int
    max_headers: int


class _Deadlines:
    """One exchange's deadlines (loop time); ``scope`` bounds the wait under way."""

    __slots__ = ("first", "idle", "loop", "scope", "total")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeouts: Timeouts) -> None:
        now = loop.time()
        self.loop = loop
        self.total = None if timeouts.total is None else now + timeouts.total
        self.first = None if timeouts.first is None else now + timeouts.first
        self.idle = timeouts.idle
        self.scope: asyncio.Timeout | None = None

    def next(self) -> float | None:
        """The deadline of a wait for bytes starting now."""
        total, first = self.total, self.first
        when = first if total is None else total if first is None else min(first, total)
        if self.idle is not None:
            idle_end = self.loop.time() + self.idle
            when = idle_end if when is None else min(when, idle_end)
        return when

    def connected(self) -> None:
        """The connection is in: from now on the wait for the head is bounded as any wait for bytes."""
        if self.scope is not None and not self.scope.expired():
            self.scope.reschedule(self.next())

    def expired(self, when: float | None) -> TimeoutError:
        """The error of a wait whose deadline ``when`` passed: FirstTimeout if it was ``first``'s.
        (Which deadline it was, not the clock: uvloop's millisecond timers may fire a little early.)"""
        if self.first is not None and when is not None and self.first <= when:
            return FirstTimeout()
        return TimeoutError()


# The exchange whose connection the connector is getting (set around ``session.post`` only).
_exchange: ContextVar[_Deadlines | None] = ContextVar("pdgate_engine_exchange", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, telling the exchange when its connection is in: until then only
    ``connect`` (and ``first``) bound it, afterwards ``idle`` and ``total`` do."""

    async def connect(self, *args: Any, **kwargs: Any) -> aiohttp.connector.Connection:
        conn = await super().connect(*args, **kwargs)
        deadlines = _exchange.get()
        if deadlines is not None:
            deadlines.connected()
        return conn


class AiohttpResponse:
    """An ``EngineResponse`` over an aiohttp ``ClientResponse``."""

    __slots__ = ("_deadlines", "_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse, deadlines: _Deadlines) -> None:
        self._resp: aiohttp.ClientResponse | None = resp
        self._deadlines = deadlines
        self.status = resp.status

    @property
    def content_length(self) -> int | None:
        raw = self.header(b"content-length")
        return int(raw) if raw is not None and raw.isdigit() else None

    def header(self, name: bytes) -> bytes | None:
        assert self._resp is not None
        for n, v in self._resp.raw_headers:
            if n.lower() == name:
                return v
        return None

    async def read_some(self) -> bytes:
        resp = self._resp
        assert resp is not None, "response already released"
        deadlines = self._deadlines
        when = deadlines.next()
        try:
            async with asyncio.timeout_at(when):
                return await resp.content.readany()
        except aiohttp.ClientError as err:
            raise _client_error(err) from None
        except TimeoutError:
            raise deadlines.expired(when) from None

    async def read(self) -> bytes:
        return await read_whole(self.read_some)

    async def splice(self, sink: BodySink) -> None:
        await splice_by_reading(self.read_some, sink)

    def end_first(self) -> None:
        self._deadlines.first = None

    def release(self) -> None:
        """aiohttp keeps the connection only if the body was received whole, as H1Client does."""
        resp, self._resp = self._resp, None
        if resp is not None:
            resp.release()

    def close(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            resp.close()


class AiohttpTransport:
    """POSTs to engines through one aiohttp ``ClientSession`` (an ``EngineTransport``), made on
    first use, on the running loop. ``tls``: the context for ``https://`` engines
    (``transport.tls_context``; unset: the system's CAs)."""

    def __init__(
        self,
        *,
        keepalive_s: float = 4.0,
        tls: ssl.SSLContext | None = None,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_headers: int = MAX_HEADERS,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._tls = tls
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers
        self._session: aiohttp.ClientSession | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def _open(self) -> aiohttp.ClientSession:
        connector = _Connector(
            limit=0, keepalive_timeout=self._keepalive_s, ssl=self._tls if self._tls is not None else True
        )
        # aiohttp bounds each line (and, from 3.13.4, the count) while it parses; the total and
        # the count are checked again once the head is in.
        limits: _HeadLimits = {"max_line_size": self._max_head_bytes, "max_field_size": self._max_head_bytes}
        if "max_headers" in inspect.signature(aiohttp.ClientSession).parameters:
            limits["max_headers"] = self._max_headers
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO,
            cookie_jar=aiohttp.DummyCookieJar(),
            **limits,
        )
        return self._session

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> AiohttpResponse:
        session = self._session or self._open()
        deadlines = _Deadlines(asyncio.get_running_loop(), timeouts)
        connect = min(timeouts.connect, timeouts.total or timeouts.connect)
        # While connecting, aiohttp's connect timeout bounds the wait; only a shorter ``first`` cuts it.
        first = deadlines.first if timeouts.first is not None and timeouts.first < connect else None
        token = _exchange.set(deadlines)
        try:
            async with asyncio.timeout_at(first) as deadlines.scope:
                resp = await session.post(
                    base_url + path,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, connect=connect),
                )
        except aiohttp.ConnectionTimeoutError as err:
            raise ConnectError(f"cannot connect to {base_url}: timed out", TimeoutError(str(err))) from None
        except aiohttp.ClientError as err:
            raise _client_error(err) from None
        except TimeoutError:
            raise deadlines.expired(deadlines.scope.when() if deadlines.scope else None) from None
        finally:
            deadlines.scope = None
            _exchange.reset(token)
        raw = resp.raw_headers
        if len(raw) > self._max_headers or sum(len(n) + len(v) + 4 for n, v in raw) > self._max_head_bytes:
            resp.close()
            raise HeadTooLarge(f"response head over {self._max_head_bytes} bytes or {self._max_headers} headers")
        return AiohttpResponse(resp, deadlines)

    def close(self) -> None:
        """Close every connection, idle or in use. aiohttp's close is a coroutine: it runs as a
        task, on the loop's next turn; no new request gets the old session meanwhile."""
        session, self._session = self._session, None
        if session is None:
            return
        task = asyncio.get_running_loop().create_task(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _client_error(err: aiohttp.ClientError) -> ClientError:
    """aiohttp's exception as the interface's (what H1Client raises in the same case)."""
    if isinstance(err, aiohttp.ClientConnectorError):
        return ConnectError(f"cannot connect to {err.host}:{err.port}: {err.os_error}", err.os_error)
    if isinstance(err, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return ServerDisconnected(f"the engine closed the connection before the response was complete: {err}")
    if isinstance(err, aiohttp.ClientPayloadError):
        if str(err).startswith("Response payload is not completed"):  # the connection ended first
            return ServerDisconnected(f"the engine closed the connection mid-response: {err}")
        return ProtocolError(f"invalid HTTP response body: {err}")
    if isinstance(err, aiohttp.ClientResponseError):  # no raise_for_status: only parsing raises it
        if err.message.startswith("Too many headers") or _caused_by(err, LineTooLong):
            return HeadTooLarge(f"response head over the limits: {err.message}")
        return ProtocolError(f"invalid HTTP response: {err.message}")
    return ClientError(f"{type(err).__name__}: {err}")


def _caused_by(err: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
