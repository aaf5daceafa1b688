"""A lean HTTP/1.1 client for the engine legs: an asyncio Protocol, httptools parsing, keep-alive pools.

One implementation of ``transport.EngineTransport`` (its contract, exceptions and timeouts live
there); ``AiohttpTransport`` is the reference it is tested against (tests/gateway/test_transport.py).
Why not aiohttp: the gateway only ever POSTs a JSON body and relays the answer, and aiohttp's
generality (a writer task per request, header multidicts, cookie jars, tracing hooks) costs more
CPU per request than the rest of the upstream exchange (``python -m bench.http_clients``).

What it does: one request per connection at a time, written in one transport write; responses
framed by content-length, chunked encoding or connection close; bodies handed over as they arrive
(never buffered whole, reading pauses when the reader falls behind); a connection goes back to its
pool only after a fully read response, and idle ones are dropped after ``keepalive_s`` (below the
engine's own keep-alive timeout, so a connection the engine is closing is never reused). Closing a
response's connection is how a request is aborted: vLLM aborts a request whose connection closes.
No Accept-Encoding is sent and nothing is decompressed. Response heads are bounded
(``max_head_bytes``, ``max_headers``). Timeouts raise ``TimeoutError``; transport failures raise
the interface's ``ClientError`` subclasses.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.engines.h1connection import Connection

# The interface's names, raised and taken here; importable from this module as before.
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
    tls_context,
    wait_drained,
)

__all__ = [
    "ClientError",
    "ConnectError",
    "FirstTimeout",
    "H1Client",
    "HeadTooLarge",
    "Pool",
    "ProtocolError",
    "Response",
    "ServerDisconnected",
    "Timeouts",
]


class Response:
    """An engine's response: status and headers are in, the body is read with ``read_some`` or
    ``read``. End it with exactly one ``release`` (keeps the connection if the response was
    read whole) or ``close`` (drops it: the engine aborts an unfinished request).
    ``Timeouts.first`` rides on the exchange's one timer: an ``asyncio.timeout`` around the call
    would cost a timer, a context manager and a cancellation check more per request."""

    __slots__ = ("_conn", "_deadline", "_first", "_idle", "_pool", "_total", "status")

    def __init__(
        self, conn: Connection, pool: Pool, deadline: float | None, idle: float | None, first: float | None = None
    ) -> None:
        self._conn: Connection | None = conn
        self._pool = pool
        self._total = deadline
        self._first = first
        self._deadline = deadline if first is None else first if deadline is None else min(first, deadline)
        self._idle = idle
        self.status = conn.status

    def end_first(self) -> None:
        """The part of the exchange ``Timeouts.first`` bounds is over."""
        self._first = None
        self._deadline = self._total

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case)."""
        assert self._conn is not None
        for n, v in self._conn.headers:
            if n == name:
                return v
        return None

    @property
    def content_length(self) -> int | None:
        raw = self.header(b"content-length")
        return int(raw) if raw is not None and raw.isdigit() else None

    async def read_some(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none has); b"" at the end."""
        conn = self._conn
        assert conn is not None, "response already released"
        while True:
            if conn.body:
                return conn.take()
            if conn.done:
                return b""
            if conn.error is not None:
                raise conn.error
            await self._wait(conn)

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        return await read_whole(self.read_some)

    async def splice(self, sink: BodySink) -> None:
        """Every remaining body byte into ``sink``, written from the parser's callback as it
        arrives: no wake-up, buffer or await per piece (the relay's cost per streamed chunk).
        The idle bound counts from the last bytes in, or from when a full sink let reading resume:
        while the sink holds the engine back, the engine cannot send and its silence is the
        client's (as with ``read_some``, whose idle bound runs only while a reader waits)."""
        conn = self._conn
        assert conn is not None, "response already released"
        while conn.body:  # what came before (and while the sink was full): in order, first
            if not sink.write(conn.take()) and not sink.stopped:
                await wait_drained(sink)
            if sink.stopped:
                return
        loop = self._pool.loop
        conn.spliced_at = loop.time()
        conn.sink = sink  # no await since the buffer was found empty: no byte can pass the sink
        try:
            while not conn.done and not sink.stopped:
                if conn.error is not None:
                    raise conn.error
                idle = None if conn.held_back else self._idle
                deadline = self._deadline
                if idle is not None:
                    idle_end = conn.spliced_at + idle
                    deadline = idle_end if deadline is None else min(idle_end, deadline)
                try:
                    await conn.wait(deadline)
                except TimeoutError:
                    now = loop.time()
                    if (self._deadline is not None and now >= self._deadline) or (
                        idle is not None and not conn.held_back and now >= conn.spliced_at + idle
                    ):
                        raise
                    # bytes came meanwhile (without waking this wait), or the sink filled up:
                    # the idle bound moves on, or waits for the resume
            if conn.error is not None and not sink.stopped:  # a stopped sink knows why it stopped
                raise conn.error
        finally:
            conn.sink = None

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.done and conn.keep_alive and not conn.closed and conn.error is None:
            conn.stop_timer()
            self._pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def _wait_head(self) -> None:
        conn = self._conn
        assert conn is not None
        while not conn.head:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise ServerDisconnected("the engine closed the connection before answering")
            await self._wait(conn)
        self.status = conn.status

    async def _wait(self, conn: Connection) -> None:
        """Until the connection has news or the nearest deadline passes (FirstTimeout when it was
        the first-token one)."""
        try:
            await conn.wait(self._next_deadline())
        except TimeoutError:
            if self._first is not None and self._pool.loop.time() >= self._first:
                raise FirstTimeout() from None
            raise

    def _next_deadline(self) -> float | None:
        if self._idle is None:
            return self._deadline
        idle_end = self._pool.loop.time() + self._idle
        return idle_end if self._deadline is None else min(idle_end, self._deadline)


class Pool:
    """Keep-alive connections to one engine (``scheme://host:port``)."""

    def __init__(
        self,
        base_url: str,
        keepalive_s: float,
        loop: asyncio.AbstractEventLoop,
        *,
        tls: ssl.SSLContext | None = None,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_headers: int = MAX_HEADERS,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        https = parts.scheme == "https"
        self.loop = loop
        self.host = parts.hostname
        self.port = parts.port or (443 if https else 80)
        self.ssl = (tls or tls_context()) if https else None
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self.keepalive_s = keepalive_s
        self._idle: deque[Connection] = deque()  # oldest first
        self._all: set[Connection] = set()
        self._pruner: asyncio.TimerHandle | None = None

    def idle_connection(self) -> Connection | None:
        """A warm idle connection, if there is one."""
        idle = self._idle
        if idle:
            fresh_after = self.loop.time() - self.keepalive_s
            while idle:
                conn = idle.pop()
                if not conn.closed and conn.idle_since > fresh_after:
                    return conn
                conn.close()
        return None

    async def connection(self, timeout: float) -> Connection:
        """A warm idle connection, else a new one."""
        conn = self.idle_connection()
        if conn is not None:
            return conn
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except OSError as err:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {err}", err) from None
        self._all.add(conn)
        return conn

    def put(self, conn: Connection) -> None:
        conn.resume()  # held back for its last reader, it must read again: the next answer, or an EOF
        conn.busy = False
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        if self._pruner is None:
            self._pruner = self.loop.call_at(conn.idle_since + self.keepalive_s, self._prune)

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            self._pruner = None
        for conn in list(self._all):
            conn.close()

    def _prune(self) -> None:
        """Close connections idle for ``keepalive_s``, before the engine closes them itself."""
        self._pruner = None
        stale_before = self.loop.time() - self.keepalive_s
        idle = self._idle
        while idle and idle[0].idle_since <= stale_before:
            idle.popleft().close()
        if idle:
            self._pruner = self.loop.call_at(idle[0].idle_since + self.keepalive_s, self._prune)


class H1Client:
    """POSTs to engines over pooled keep-alive connections, one pool per base URL (an
    ``EngineTransport``). ``tls``: the context for ``https://`` engines (``transport.tls_context``;
    unset: the system's CAs, no client certificate)."""

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
        self._pools: dict[str, Pool] = {}

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> Response:
        """Send the request and return once the response's status and headers are in."""
        pool = self._pools.get(base_url)
        if pool is None:
            if self._tls is None and base_url.startswith("https:"):
                self._tls = tls_context()  # once per client: building one reads the CA store
            pool = self._pools[base_url] = Pool(
                base_url,
                self._keepalive_s,
                asyncio.get_running_loop(),
                tls=self._tls,
                max_head_bytes=self._max_head_bytes,
                max_headers=self._max_headers,
            )
        now = pool.loop.time()
        deadline = None if timeouts.total is None else now + timeouts.total
        first = None if timeouts.first is None else now + timeouts.first
        head = _request_head(path, pool.host_header, headers, len(body))
        conn = pool.idle_connection()
        if conn is None:
            connect = min(timeouts.connect, timeouts.total or timeouts.connect)
            if timeouts.first is None or timeouts.first >= connect:
                conn = await pool.connection(connect)
            else:  # ``first`` runs out before the connect timeout would: a FirstTimeout, not a ConnectError
                try:
                    async with asyncio.timeout(timeouts.first):
                        conn = await pool.connection(connect)
                except TimeoutError:
                    raise FirstTimeout() from None
        resp = Response(conn, pool, deadline, timeouts.idle, first)
        try:
            conn.send(head + body)
            await resp._wait_head()
        except BaseException:
            resp.close()  # also on cancellation: the engine sees the connection drop and aborts
            raise
        return resp

    def close(self) -> None:
        """Close every connection, idle or in use."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request_head(target: str, host: bytes, headers: Mapping[str, str], length: int) -> bytes:
    lines = [b"POST ", target.encode("ascii"), b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    lines.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(lines)
