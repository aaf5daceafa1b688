"""The gateway's HTTP front: uvicorn's httptools protocol behind a guard that bounds what one client
can make the gateway hold before a request reaches the app.

uvicorn's httptools protocol buffers a request head without limit (its parser joins a header's
pieces, so the cost grows faster than the bytes) and waits for it forever; a connection that
sends nothing stays open. The guard sees every byte first, parses the framing with its own
``httptools`` parser (the same C parser: a second pass costs ~2-5 us a request, docs/benchmarks.md)
and passes the bytes on unchanged, or cuts the connection short:

- a request head (request line and headers) over ``max_head_bytes``, or with more than
  ``max_headers`` headers, is answered 431 as soon as it passes the limit;
- a head that does not arrive whole within ``head_timeout_s`` (from the connection's start for
  the first request, from its first byte for later ones) is answered 408;
- malformed HTTP is answered 400 in the OpenAI error shape (not uvicorn's plain text);
- past ``max_connections`` open connections, a new one is answered 503 and closed, with a log
  line (at most one every 10 s).

Each of these closes the connection. On a connection that already carried a request the guard
only closes it (a response of its own could land in the middle of an earlier one).

After the head, a connection must not outlive its exchange either. A route that answers without
reading the body (``/health``, ``/metrics``, a 401 for a missing key, 404, 405, a 413 on the
declared length) left the body phase unbounded, and the body's next bytes cancelled uvicorn's
keep-alive timer: a client that declared a body, read the answer and sent one byte held its
connection for good, without a key (issue 27). So the guard also watches the response bytes
uvicorn writes (through ``_Watched``, a transport wrapper; a second httptools parser frames them):

- a body must arrive whole within ``body_timeout_s`` and with no gap over ``body_idle_timeout_s``
  (``BODY_GRACE_S`` more than the app's own 408, gateway/request/exchange.py, which comes first where it
  reads the body), counted while the client may send (not while uvicorn holds reading back); past
  them the guard answers 408 if nothing was answered yet, and closes;
- an answer written before its request's body has arrived, and every 401, 403, 408 and 413, gets
  ``connection: close`` and the connection is closed once the answer is written: what has no key,
  or whose body was refused, holds nothing after its answer;
- between requests, uvicorn's keep-alive timer (``server.keep_alive_timeout_s``) holds: bytes can
  no longer arrive after an answer without starting the next request's head, which the head
  timer bounds.
- bytes waiting for a client (the transport's buffer above its high-water mark, or a close
  waiting for it to empty) of which the client takes none for ``stall_timeout_s`` get the
  connection reset: a stream nobody reads would hold an engine request and an admission slot
  for good.
- an upgrade request is answered as plain HTTP (the gateway serves no WebSockets: uvicorn's
  upgrade would hand the socket to another protocol behind the guard's back, and the connection
  would never leave the count), what follows it is dropped, and the connection closes after it.

The guard composes uvicorn's protocol (it constructs it with the arguments uvicorn gives every
``http`` protocol class, forwards the asyncio protocol calls, and hands it the wrapped transport);
it touches none of its internals. tests/gateway/test_server.py fails if uvicorn changes that
construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections import deque
from typing import Any, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http.connections import Connections, Limits
from gateway.http.splice import CONNECTION, BodyWriter

log = logging.getLogger(__name__)

LINGER_S = 1.0  # how long a cut connection stays open for the client to read the answer
BODY_GRACE_S = 1.0  # the guard's body bounds trail the app's (gateway/request/exchange.py): its 408 comes first
CLOSE_AFTER = frozenset({401, 403, 408, 413})  # answers after which the connection is closed
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None  # (its layout)
_TCP_INFO_LEN = 104
_LAST_DATA_RECV = 52  # struct tcp_info's tcpi_last_data_recv (u32, ms), linux/tcp.h
_BYTES_ACKED, _ACKED_LEN = 120, 128  # its tcpi_bytes_acked (u64, Linux 4.1+)
_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def guarded_protocol(limits: Limits, connections: Connections | None = None) -> type[asyncio.Protocol]:
    """An ``http`` protocol class for uvicorn, bound to ``limits`` (one per server)."""
    shared = connections or Connections(limits.max_connections)

    class Guarded(GuardedProtocol):
        LIMITS = limits
        CONNECTIONS = shared

    return Guarded


def _response(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "param": None,
                "code": code,
            }
        }
    )
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _Watched:
    """The transport uvicorn's protocol writes through: every call goes to the real one, and the
    guard sees the response bytes (framing, status) and uvicorn holding reading back. A connection
    the guard has cut takes nothing more from uvicorn: its writes and closes are dropped (the guard
    closes it after ``LINGER_S``)."""

    def __init__(self, transport: asyncio.Transport, guard: GuardedProtocol) -> None:
        self._transport = transport
        self._guard = guard

    def write(self, data: bytes | bytearray | memoryview) -> None:
        guard = self._guard
        if guard._done:
            return
        if guard._responses is None:
            self._transport.write(data)
        else:
            guard._response_bytes(data)

    def writelines(self, data: Any) -> None:
        self.write(b"".join(data))

    def close(self) -> None:
        if not self._guard._done:
            self._guard._flush_head()  # a response cut short after its head: the head still goes
            self._transport.close()
            self._guard._closing_with_bytes()

    def pause_reading(self) -> None:
        if not self._guard._done:  # a cut connection drains what still comes, until it closes
            self._guard._reading_paused(True)
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if not self._guard._done:
            self._guard._reading_paused(False)
            self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Responses:
    """httptools callbacks for the responses uvicorn writes (a separate object: the guard's own
    callbacks are the request parser's)."""

    def __init__(self, guard: GuardedProtocol) -> None:
        self._guard = guard

    def on_message_begin(self) -> None:
        self._guard._chunked = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
            self._guard._chunked = True

    def on_headers_complete(self) -> None:
        self._guard._response_head()

    def on_message_complete(self) -> None:
        self._guard._response_done()


class GuardedProtocol(asyncio.Protocol):
    LIMITS: Limits = Limits()
    CONNECTIONS: Connections = Connections(0)

    def __init__(
        self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._inner = HttpToolsProtocol(config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self._loop = _loop or asyncio.get_event_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._entered = False  # counted in CONNECTIONS, and handed to uvicorn's protocol
        self._done = False  # cut short: nothing more goes to uvicorn, nor from it
        self._upgrade = False  # a request asked for another protocol: what follows it is not HTTP/1
        self._in_head = True
        self._head_raw = 0  # bytes of chunks that were all head
        self._head_size = 0  # request target + header names and values, as parsed
        self._headers = 0
        self._requests = 0  # heads completed on this connection
        self._rejection: tuple[int, str, str] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the head's, then the body's (one at a time)
        self._stall: asyncio.TimerHandle | None = None  # bytes wait for the client: its deadline to take some
        self._stall_taken = 0  # what the client had taken when that timer was armed (``_taken``)
        self._ending = False  # the client sent its FIN, or the connection is being closed: no resume cancels it
        self._lost = False
        self._socket: Any = None
        # the body phase: from the end of a head to the end of its message
        self._in_body = False
        self._body_started = self._body_deadline = self._last_byte = 0.0
        self._paused_at: float | None = None  # uvicorn holds reading back (the client cannot send)
        # the responses uvicorn writes, framed by their own parser (None: not watched any more)
        self._responses: httptools.HttpResponseParser | None = None
        self._heads: deque[bool] = deque()  # per request not answered yet: whether it is a HEAD
        self._begun = 0  # final responses whose head was written
        self._answered = 0  # final responses written whole
        self._interim = False  # the response being parsed is a 1xx (100 Continue)
        self._close_after = False  # close once the response being written is whole
        self._announce = False  # ... and say so in its head (``connection: close``)
        self._head_only = False  # the response just begun answers a HEAD: its head is all of it
        self._chunked = False  # the response being written is framed in chunks
        self._writer: BodyWriter | None = None  # the relay's direct body writer (gateway/http/splice.py)
        self._head_now = False  # the write being framed completed a response head
        self._held_head: bytes | None = None  # that head, until the body's first bytes join it
        self._watched: _Watched | None = None  # the transport uvicorn's protocol writes through

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's signature names the base class; a stream connection's transport is a Transport
        # (uvloop's implements its methods without subclassing it: no isinstance check)
        self._transport = cast(asyncio.Transport, transport)
        if not self.CONNECTIONS.enter():
            self._refuse(503, "The gateway has too many open connections; retry later.", "too_many_connections")
            return
        self._entered = True
        self._socket = self._transport.get_extra_info("socket")
        self._responses = httptools.HttpResponseParser(_Responses(self))
        self._watched = _Watched(self._transport, self)
        self._inner.connection_made(cast(asyncio.Transport, self._watched))
        self._timer = self._loop.call_later(self.LIMITS.head_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._done or self._upgrade:  # after an upgrade request: not HTTP/1, and nobody here speaks it
            return  # (dropped until its answer is written and closes the connection)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgrade = True  # uvicorn answers it as plain HTTP (no ``ws``); then it closes
        except httptools.HttpParserCallbackError:
            pass  # a limit raised it: the rejection below says which
        except httptools.HttpParserError as err:
            self._refuse(400, f"Invalid HTTP request: {err}.", "invalid_http")
            return
        if self._rejection is None and self._in_head:
            self._head_raw += len(data)  # the whole chunk was head
            if self._head_raw > self.LIMITS.max_head_bytes:
                self._reject_head()
        if self._rejection is not None:
            self._refuse(*self._rejection)
            return
        if self._in_body:  # these bytes were body (or ended a head): the body is alive
            self._last_byte = self._loop.time()
            if self._timer is None and self._paused_at is None:
                self._timer = self._loop.call_at(self._body_due(), self._body_check)
        token = CONNECTION.set(self)  # the ASGI task uvicorn starts here knows its connection
        try:
            self._inner.data_received(data)
        finally:
            CONNECTION.reset(token)

    def eof_received(self) -> bool | None:
        if self._entered:
            self._inner.eof_received()  # uvicorn's returns None: the transport closes itself
        self._closing_with_bytes()  # ... once its buffer is read: a deadline for that
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._entered:
            self._entered = False
            self.CONNECTIONS.leave()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._watch_stall()
        if self._entered:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._stall is not None and not self._ending:  # (a closing one keeps its deadline)
            self._stall.cancel()
            self._stall = None
        if self._entered:
            self._inner.resume_writing()
            if self._writer is not None:
                self._writer.resume_writing()

    def body_writer(self) -> BodyWriter | None:
        """A direct writer for the body of the response under way (gateway/http/splice.py):
        only while one is, framed in chunks, on a connection still watched."""
        if (
            self._done
            or self._responses is None
            or self._transport is None
            or self._watched is None
            or not self._chunked
            or self._head_only
            or self._begun != self._answered + 1
        ):
            return None
        self._flush_head()  # its chunks go straight to the transport: after the head
        self._writer = BodyWriter(self._transport)
        return self._writer

    # -- httptools callbacks (framing only) ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_raw = self._head_size = self._headers = 0
        if self._timer is None:
            self._timer = self._loop.call_later(self.LIMITS.head_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        self._head_size += len(name) + len(value) + 4
        if self._headers > self.LIMITS.max_headers or self._head_size > self.LIMITS.max_head_bytes:
            self._reject_head()
            raise ValueError("request head over the limits")  # stops this parse

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._requests += 1
        if self._requests == 1 and _TCP_INFO is not None and self._socket is not None:
            with contextlib.suppress(OSError):  # the kernel's ms since the request's last bytes arrived
                info = self._socket.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
                self.CONNECTIONS.waited(struct.unpack_from("I", info, _LAST_DATA_RECV)[0] / 1000)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._head_size > self.LIMITS.max_head_bytes:
            self._reject_head()
        if self._responses is not None:
            self._heads.append(self._parser.get_method() == b"HEAD")
        # the body phase, until on_message_complete (at once, in this same parse, without a body);
        # its timer is set once the parse is done
        self._in_body = True
        self._body_started = self._last_byte = now = self._loop.time()
        self._body_deadline = now + self.LIMITS.body_timeout_s + BODY_GRACE_S

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the body phase --------------------------------------------------------------------------------

    def _body_due(self) -> float:
        return min(self._body_deadline, self._last_byte + self.LIMITS.body_idle_timeout_s + BODY_GRACE_S)

    def _body_check(self) -> None:
        """The body's timer: one per body, moved on lazily (not on every chunk)."""
        self._timer = None
        if self._done or not self._in_body or self._paused_at is not None:
            return  # ended, or on hold: ``_reading_paused`` sets it again
        due = self._body_due()
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._body_check)
            return
        lim = self.LIMITS
        # answer only when no response has begun on this connection that is not whole (and this
        # request's own has not begun): a 408 of ours must not land inside another answer
        unanswered = self._responses is not None and self._begun == self._answered == self._requests - 1
        self._refuse(
            408,
            f"The request body did not arrive within {lim.body_timeout_s:g} s, or stopped for "
            f"{lim.body_idle_timeout_s:g} s.",
            "request_timeout",
            answer=unanswered,
        )

    def _reading_paused(self, paused: bool) -> None:
        """uvicorn holds reading back (a pipelined request waits, or the app has not taken the body
        buffered so far): the client cannot send meanwhile, so that time is not the body's."""
        now = self._loop.time()
        if paused:
            if self._paused_at is None:
                self._paused_at = now
            return
        if self._paused_at is None:
            return
        held_since, self._paused_at = self._paused_at, None
        if self._in_body and not self._done:
            self._body_deadline += now - max(held_since, self._body_started)
            self._last_byte = now
            if self._timer is None:
                self._timer = self._loop.call_at(self._body_due(), self._body_check)

    # -- the responses uvicorn writes ------------------------------------------------------------------

    def _response_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Frame ``data`` (a write of uvicorn's) before it goes out; on a response that closes the
        connection, announce it in the head and close once its last byte is written."""
        responses = self._responses
        assert responses is not None and self._transport is not None
        self._announce = False
        try:
            responses.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101: not uvicorn's without ``ws``, but then not HTTP/1 any more
            self._unwatch()
        except httptools.HttpParserError as err:  # not expected of uvicorn: stop watching, keep serving
            log.debug("response framing lost (%s): this connection is not watched any more", err)
            self._unwatch()
        if self._head_only:  # a HEAD's answer: its parser would wait for the body it announced
            self._head_only = False
            self._response_done()
            if self._responses is not None:
                self._responses = httptools.HttpResponseParser(_Responses(self))
        if self._announce and isinstance(data, bytes) and data.startswith(b"HTTP/1."):
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                data = data[: end + 2] + b"connection: close\r\n" + data[end + 2 :]
        if self._held_head is not None:
            data, self._held_head = self._held_head + data, None
        if self._head_now:
            self._head_now = False
            if self._responses is not None and self._begun > self._answered:
                # uvicorn writes a head alone, then the body: held until the body's first bytes
                # (the same task step, as a rule), it leaves in one write system call with them
                self._held_head = bytes(data)
                self._loop.call_soon(self._flush_head)
                return
        self._transport.write(data)
        if self._close_after and self._answered == self._begun:
            self._cut()  # written whole: close

    def _response_head(self) -> None:
        responses = self._responses
        assert responses is not None
        status = responses.get_status_code()
        self._interim = 100 <= status < 200 and status != 101
        if self._interim:
            return
        self._begun += 1
        self._head_now = True
        head_only = self._heads.popleft() if self._heads else False
        # answered before the request's body arrived: what is left of it is nobody's
        early = self._in_body and self._begun == self._requests
        if early or status in CLOSE_AFTER or (self._upgrade and self._begun == self._requests):
            self._close_after = True
            self._announce = responses.should_keep_alive()  # not said yet
        self._head_only = head_only

    def _response_done(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._writer = None
        self._head_only = False  # whole by its own framing (a 204, a HEAD answered with length 0)
        self._answered += 1

    def _flush_head(self) -> None:
        """A held head goes out (no body bytes came in its task step, or the connection closes)."""
        held, self._held_head = self._held_head, None
        if held is not None and self._transport is not None and not self._transport.is_closing():
            self._transport.write(held)

    def _unwatch(self) -> None:
        self._responses = None
        self._heads.clear()

    # -- cutting a connection short --------------------------------------------------------------------

    def _reject_head(self) -> None:
        if self._rejection is None:
            lim = self.LIMITS
            self._rejection = (
                431,
                f"Request headers exceed {lim.max_head_bytes} bytes or {lim.max_headers} headers.",
                "headers_too_large",
            )

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._in_head and not self._done:
            self._refuse(
                408, f"The request head did not arrive within {self.LIMITS.head_timeout_s:g} s.", "request_timeout"
            )

    def _closing_with_bytes(self) -> None:
        """The connection closes (cut, closed, its client's FIN) once the client has read what
        waits for it: until it is lost, only the stall bound ends it."""
        self._ending = True
        if self._transport is not None and self._transport.get_write_buffer_size():
            self._watch_stall()

    def _watch_stall(self) -> None:
        """Bytes wait for the client (a full buffer, or a close that waits for the buffer to
        empty): from now on the client must take some every ``stall_timeout_s``."""
        if self._stall is None and self._transport is not None and not self._lost:
            self._stall_taken = self._taken(self._transport)
            self._stall = self._loop.call_later(self.LIMITS.stall_timeout_s, self._stalled)

    def _taken(self, transport: asyncio.Transport) -> int:
        """A count that grows as the client takes bytes: those it acknowledged (the kernel's
        TCP_INFO; the transport's own buffer only shrinks once the kernel's is half empty, which
        a slow reader may take minutes to do), else minus the transport's buffer."""
        if _TCP_INFO is not None and self._socket is not None:
            with contextlib.suppress(OSError):
                info = self._socket.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _ACKED_LEN)
                if len(info) >= _ACKED_LEN:
                    return int(struct.unpack_from("Q", info, _BYTES_ACKED)[0])
        return -transport.get_write_buffer_size()

    def _stalled(self) -> None:
        """The client took none of the bytes waiting for it in ``stall_timeout_s``: the stream
        holds an engine request, an admission slot and the buffer for nobody (a cut or closing
        connection, its slot and the close itself). Reset at once (what is buffered would never
        be read); uvicorn's protocol sees the connection lost, the request's task the client
        gone, and the engine's request is aborted as for any client that leaves. A client that
        took some, however slowly, gets another period."""
        self._stall = None
        transport = self._transport
        if transport is None:
            return
        if transport.get_write_buffer_size() == 0 and not transport.is_closing():
            return  # nothing waits any more
        if self._taken(transport) > self._stall_taken:  # the client took some: another period
            self._watch_stall()
            return
        self.CONNECTIONS.stalled_out()
        self._end()
        if self._socket is not None:  # a reset: else the kernel would go on offering the client its buffer
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    def _end(self) -> None:
        """Nothing more goes to uvicorn's protocol or comes from it or the relay's writer; the
        head or body timer stops."""
        self._done = True
        if self._writer is not None:
            self._writer.cut()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _refuse(self, status: int, message: str, code: str, *, answer: bool | None = None) -> None:
        """Answer (``answer``; by default on a connection that has not carried a request yet) and
        close."""
        if answer is None:
            answer = self._requests == 0 or (status == 431 and self._requests == 1 and self._in_head is False)
        self._cut(_response(status, message, code) if answer else None)

    def _cut(self, answer: bytes | None = None) -> None:
        """Write ``answer``, if any, and close. The close lingers (``LINGER_S``, what arrives
        meanwhile is dropped unread): closing a socket with unread bytes resets it, and the client
        would lose the answer."""
        self._flush_head()
        self._end()
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if answer is not None:
            transport.write(answer)
        if self._paused_at is not None:  # uvicorn held reading back: drain what the client still sends
            self._paused_at = None
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()
        self._closing_with_bytes()
