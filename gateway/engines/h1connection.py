"""One keep-alive connection to an engine, as an asyncio Protocol (gateway/engines/h1client.py's wire).

It writes a request in one transport write and parses the response with httptools: the head
(bounded: ``max_head_bytes``, ``max_headers``), then the body, framed by content-length, chunked
encoding or the connection's close. Body bytes are buffered for a reader (reading pauses past
``READ_HIGH_WATER``) or, spliced, written straight into a sink from the parser's callback (reading
pauses while the sink is full). Any byte nobody asked for retires the connection. ``Response``,
``Pool`` and ``H1Client`` (h1client.py) build the exchange API on it.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, cast

import httptools

from gateway.engines.transport import (
    BodySink,
    ClientError,
    HeadTooLarge,
    ProtocolError,
    ServerDisconnected,
)

if TYPE_CHECKING:
    from gateway.engines.h1client import Pool

# Past this many unread body bytes, stop reading the socket until the reader catches up.
READ_HIGH_WATER = 1 << 18
# Raw bytes a head may take beyond ``max_head_bytes`` before it is complete: the status line and
# whitespace the parser trims, which the fields' count leaves out.
HEAD_SLACK = 1 << 12


class Connection(asyncio.Protocol):
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
        self._reset()  # (held back for a last reader? the pool resumed it when it took it back)
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

    @property
    def held_back(self) -> bool:
        """Reading is paused (for a slow reader or a full sink): the engine cannot send."""
        return self._paused

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
            if self.sink is not None:  # the engine could not send while held back: its idle clock
                self.spliced_at = self._loop.time()  # starts again now, and the waiter re-arms it
                self._wake()

    def on_message_complete(self) -> None:
        if self.head and not self.done:
            self.done = True
            self.keep_alive = self._parser.should_keep_alive()
