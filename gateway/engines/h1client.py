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
import socket
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

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

# Past this many unread body bytes, stop reading the socket until the reader catches up.
READ_HIGH_WATER = 1 << 18
# Raw bytes a head may take beyond ``max_head_bytes`` before it is complete: the status line and
# whitespace the parser trims, which the fields' count leaves out.
HEAD_SLACK = 1 << 12


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._max_head = pool.max_head_bytes
        self._max_headers = pool.max_headers
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False  # an exchange is under way (a response is expected or being read)
        self.idle_since = 0.0
        # One timer per exchange, re-armed only when it fires early: a stream's every chunk is a
        # wait with a fresh idle deadline, and a timer per wait would cost more than the chunk.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline: float | None = None
        self._exchanges = 0  # sent on it so far: a sink's late drain call belongs to one of them
        self._paused = False  # reading held back (a slow reader, a full sink): see ``resume``
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0  # header fields' size as the limit counts it (name + value + 4)
        self.head_raw = 0  # bytes received while the head was incomplete
        self.head = False  # status line and headers parsed
        self.done = False  # the whole message parsed
        self.keep_alive = False
        self.until_close = False  # the body ends when the connection does
        self.error: ClientError | None = None
        self.body: list[bytes] = []
        self.buffered = 0
        self.sink: BodySink | None = None  # splicing: body bytes go straight there, nobody is woken
        self.spliced_at = 0.0  # when the last body bytes went into the sink
        self._held: list[bytes] = []  # spliced body pieces of the read under way, written as one
        self._waiter: asyncio.Future[None] | None = None

    # ---- exchange
    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.resume()  # (the pool resumes what it takes back: this is for any other way in)
        self._reset()
        self._exchanges += 1
        self.busy = True
        self.transport.write(data)

    async def wait(self, deadline: float | None) -> None:
        """Until the parser makes progress or the connection ends; TimeoutError at ``deadline``."""
        self._deadline = deadline
        if deadline is not None and (self._timer is None or self._timer_at > deadline):
            self._arm(deadline)
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        waiter, deadline = self._waiter, self._deadline
        if waiter is None or waiter.done() or deadline is None:
            return  # nobody waiting: the next wait arms a timer again
        if self._loop.time() >= deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(deadline)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> bytes:
        """Every body byte buffered so far."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        self.buffered = 0
        self.resume()
        return data

    def resume(self) -> None:
        """Read the socket again if it was held back (for a slow reader or a full sink)."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.busy = False
        self.stop_timer()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self._pool.forget(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's signature names the base class; a stream connection's transport is a Transport
        # (uvloop's implements its methods without subclassing it: no isinstance check)
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.done:  # nothing asked for this: the connection cannot be trusted
            self.error = self.error or ProtocolError("unexpected data from the engine")
            self.close()
            self._wake()
            return
        try:
            self._parser.feed_data(data)
            if self._held:
                self._pass_held()
            if not self.head:  # httptools holds a partial header in memory: bound what it may hold
                self.head_raw += len(data)
                if self.head_raw > self._max_head + HEAD_SLACK:
                    raise HeadTooLarge(f"response head over {self._max_head} bytes")
        except httptools.HttpParserError as err:  # a callback's own error comes as the context
            if self._held:  # what parsed before the error still goes on
                self._pass_held()
            cause = err.__context__
            self.error = cause if isinstance(cause, ClientError) else ProtocolError(f"invalid HTTP response: {err}")
            self.close()
        except ClientError as err:
            self.error = err
            self.close()
        else:
            sink = self.sink
            if sink is not None and not self.done and not sink.stopped:
                return  # spliced: the waiter only wants the end, an error, a stop or its timer
            if self.buffered > READ_HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost ends the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy and not self.done:
            if self.head and self.until_close and exc is None:
                self.done = True
            elif self.error is None:
                self.error = ServerDisconnected("the engine closed the connection mid-response")
        self.closed = True
        self._pool.forget(self)
        self._wake()

    # ---- httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:  # a second response nobody asked for: never reuse this connection
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            headers = self.headers
            headers.append((name.lower(), value))
            self.head_bytes += len(name) + len(value) + 4
            if self.head_bytes > self._max_head:
                raise HeadTooLarge(f"response head over {self._max_head} bytes")
            if len(headers) > self._max_headers:
                raise HeadTooLarge(f"response head with over {self._max_headers} headers")

    def on_headers_complete(self) -> None:
        if self.done:
            return
        status = self._parser.get_status_code()
        if status < 200:  # informational (100 Continue): the real response follows
            self.headers = []
            self.head_bytes = self.head_raw = 0
            return
        self.status = status
        framed = any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers)
        self.until_close = not framed and status not in (204, 304)
        self.head = True

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        sink = self.sink
        if sink is None:
            self.body.append(body)
            self.buffered += len(body)
            return
        if sink.stopped:  # the relay wants no more: what follows is dropped, the connection closed
            return
        self._held.append(body)  # the read's other pieces may follow: one write for all of them

    def _pass_held(self) -> None:
        """The spliced pieces of one read into the sink in one write: events that arrive together
        (an engine answering several streams writes them back to back) cost one client write
        system call, not one each."""
        held = self._held
        body = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        sink = self.sink
        if sink is None or sink.stopped:
            return
        self.spliced_at = self._loop.time()
        if not sink.write(body) and not self._paused and self.transport is not None:
            self._paused = True  # the client reads slower than the engine writes: hold the engine back
            self.transport.pause_reading()
            exchange = self._exchanges
            sink.drained(lambda: self._sink_drained(exchange))

    def _sink_drained(self, exchange: int) -> None:
        """The sink of ``exchange`` drained. Its answer may have ended meanwhile (its last bytes
        came in the read that filled the sink) and the connection carry another exchange now,
        whose own holding back is not this sink's to end."""
        if exchange == self._exchanges and not self.closed:
            self.resume()

    def on_message_complete(self) -> None:
        if self.head and not self.done:
            self.done = True
            self.keep_alive = self._parser.should_keep_alive()


class Response:
    """An engine's response: status and headers are in, the body is read with ``read_some`` or
    ``read``. End it with exactly one ``release`` (keeps the connection if the response was
    read whole) or ``close`` (drops it: the engine aborts an unfinished request).
    ``Timeouts.first`` rides on the exchange's one timer: an ``asyncio.timeout`` around the call
    would cost a timer, a context manager and a cancellation check more per request."""

    __slots__ = ("_conn", "_deadline", "_first", "_idle", "_pool", "_total", "status")

    def __init__(
        self, conn: _Connection, pool: Pool, deadline: float | None, idle: float | None, first: float | None = None
    ) -> None:
        self._conn: _Connection | None = conn
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
        The idle bound counts from the last bytes in; it is checked when the one timer fires."""
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
                idle = self._idle
                deadline = self._deadline
                if idle is not None:
                    idle_end = conn.spliced_at + idle
                    deadline = idle_end if deadline is None else min(idle_end, deadline)
                try:
                    await conn.wait(deadline)
                except TimeoutError:
                    now = loop.time()
                    if (self._deadline is not None and now >= self._deadline) or (
                        idle is not None and now >= conn.spliced_at + idle
                    ):
                        raise
                    # bytes came meanwhile (without waking this wait): the idle bound moves on
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

    async def _wait(self, conn: _Connection) -> None:
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
        self._idle: deque[_Connection] = deque()  # oldest first
        self._all: set[_Connection] = set()
        self._pruner: asyncio.TimerHandle | None = None

    def idle_connection(self) -> _Connection | None:
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

    async def connection(self, timeout: float) -> _Connection:
        """A warm idle connection, else a new one."""
        conn = self.idle_connection()
        if conn is not None:
            return conn
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except OSError as err:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {err}", err) from None
        self._all.add(conn)
        return conn

    def put(self, conn: _Connection) -> None:
        conn.resume()  # held back for its last reader, it must read again: the next answer, or an EOF
        conn.busy = False
        conn.idle_since = self.loop.time()
        self._idle.append(conn)
        if self._pruner is None:
            self._pruner = self.loop.call_at(conn.idle_since + self.keepalive_s, self._prune)

    def forget(self, conn: _Connection) -> None:
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
