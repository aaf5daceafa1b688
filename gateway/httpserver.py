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
only closes it (a response of its own could land in the middle of an earlier one). Bodies are
bounded by the app: size (``server.max_body_bytes``) and read timeouts (gateway/exchange.py);
idle keep-alive connections by uvicorn's ``timeout_keep_alive``.

The guard composes uvicorn's protocol (it constructs it with the arguments uvicorn gives every
``http`` protocol class and forwards the asyncio protocol calls); it touches none of its internals.
tests/gateway/test_httpserver.py fails if uvicorn changes that construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import GatewayConfig

log = logging.getLogger(__name__)

LINGER_S = 1.0  # how long a cut connection stays open for the client to read the answer
SMOOTHING = 0.3  # a new sample's weight: one scheduling hiccup is not an overload, a sustained wait is
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)  # Linux
_TCP_INFO_LEN = 104
_LAST_DATA_RECV = 52  # struct tcp_info's tcpi_last_data_recv (u32, ms), linux/tcp.h
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


@dataclass(frozen=True)
class Limits:
    max_head_bytes: int = 16384  # request line + headers
    max_headers: int = 100
    head_timeout_s: float = 10.0
    max_connections: int = 10000


class Connections:
    """Open connections of one server, and the rate-limited log line when the cap is reached.

    ``wait_s``: how long new connections' first requests waited in the kernel before this process
    read them (smoothed; gateway/admission.py LoopLag decays it). A saturated uvloop accepts new
    connections late while its timers still fire on time, so this, not the timers' lateness, is
    what shows the gateway is past its capacity for new streams."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0
        self.wait_s = 0.0
        self._logged = 0.0

    def waited(self, seconds: float) -> None:
        self.wait_s += (seconds - self.wait_s) * SMOOTHING

    def enter(self) -> bool:
        if self.limit and self.open >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= 10.0:
                self._logged = now
                log.warning("%d connections open, the limit (server.max_connections): refusing new ones "
                            "(%d refused so far)", self.open, self.refused)
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


def make_server(cfg: GatewayConfig, build_app: Callable[[Connections], Any], *, host: str, port: int,
                log_level: str, max_connections: int | None = None) -> uvicorn.Server:
    """The uvicorn server for ``cfg``, behind the guard; ``build_app`` gets the connection count
    (for /metrics). ``max_connections``: this process's share of ``server.max_connections``."""
    cap = cfg.server.max_connections if max_connections is None else max_connections
    limits = Limits(max_head_bytes=cfg.limits.max_header_bytes, max_headers=cfg.limits.max_headers,
                    head_timeout_s=cfg.server.head_timeout_s, max_connections=cap)
    connections = Connections(limits.max_connections)
    # No proxy-headers middleware: nothing reads the client address, and it wraps every request.
    return uvicorn.Server(uvicorn.Config(
        build_app(connections), host=host, port=port, loop="uvloop", http=guarded_protocol(limits, connections),
        access_log=False, proxy_headers=False, log_level=log_level, server_header=False,
        # uvicorn annotates it int, but only hands it to asyncio.wait_for: seconds, fractions work
        timeout_graceful_shutdown=cast(int, cfg.server.shutdown_grace_s),
    ))


def guarded_protocol(limits: Limits, connections: Connections | None = None) -> type[asyncio.Protocol]:
    """An ``http`` protocol class for uvicorn, bound to ``limits`` (one per server)."""
    shared = connections or Connections(limits.max_connections)

    class Guarded(GuardedProtocol):
        LIMITS = limits
        CONNECTIONS = shared

    return Guarded


def _response(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "param": None, "code": code}})
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedProtocol(asyncio.Protocol):
    LIMITS: Limits = Limits()
    CONNECTIONS: Connections = Connections(0)

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._inner = HttpToolsProtocol(config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        self._loop = _loop or asyncio.get_event_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._entered = False  # counted in CONNECTIONS, and handed to uvicorn's protocol
        self._done = False  # cut short: nothing more goes to uvicorn
        self._passthrough = False  # an upgrade: not HTTP/1 requests any more
        self._in_head = True
        self._head_raw = 0  # bytes of chunks that were all head
        self._head_size = 0  # request target + header names and values, as parsed
        self._headers = 0
        self._requests = 0  # heads completed on this connection
        self._rejection: tuple[int, str, str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._socket: Any = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's signature names the base class; a stream connection's transport is a Transport
        # (uvloop's implements its methods without subclassing it: no isinstance check)
        self._transport = cast(asyncio.Transport, transport)
        if not self.CONNECTIONS.enter():
            self._cut(503, "The gateway has too many open connections; retry later.", "too_many_connections")
            return
        self._entered = True
        self._socket = self._transport.get_extra_info("socket")
        self._inner.connection_made(self._transport)
        self._timer = self._loop.call_later(self.LIMITS.head_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        if not self._passthrough:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._passthrough = True
            except httptools.HttpParserCallbackError:
                pass  # a limit raised it: the rejection below says which
            except httptools.HttpParserError as err:
                self._cut(400, f"Invalid HTTP request: {err}.", "invalid_http")
                return
            if self._rejection is None and self._in_head:
                self._head_raw += len(data)  # the whole chunk was head
                if self._head_raw > self.LIMITS.max_head_bytes:
                    self._reject_head()
            if self._rejection is not None:
                self._cut(*self._rejection)
                return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._entered:
            self._inner.eof_received()  # uvicorn's returns None: the transport closes itself
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._entered:
            self._entered = False
            self.CONNECTIONS.leave()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._entered:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._entered:
            self._inner.resume_writing()

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

    # -- cutting a connection short --------------------------------------------------------------------

    def _reject_head(self) -> None:
        if self._rejection is None:
            lim = self.LIMITS
            self._rejection = (431, f"Request headers exceed {lim.max_head_bytes} bytes or {lim.max_headers} "
                               "headers.", "headers_too_large")

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._in_head and not self._done:
            self._cut(408, f"The request head did not arrive within {self.LIMITS.head_timeout_s:g} s.",
                      "request_timeout")

    def _cut(self, status: int, message: str, code: str) -> None:
        """Answer (on a connection that has not carried a request yet) and close. The close lingers
        (``LINGER_S``, what arrives meanwhile is dropped unread): closing a socket with unread bytes
        resets it, and the client would lose the answer."""
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._requests == 0 or (status == 431 and self._requests == 1 and self._in_head is False):
            transport.write(_response(status, message, code))
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()
