"""The engine legs' HTTP client, as an interface: what ``upstream`` and ``legs`` need, nothing more.

Two implementations pass one conformance suite (tests/gateway/test_transport.py): ``H1Client``
(gateway/engines/h1client.py, the project's own HTTP/1.1 client, chosen for its CPU cost per request:
docs/benchmarks.md, "Upstream HTTP client") and ``AiohttpTransport`` (gateway/engines/transport_aiohttp.py,
on a well-kept library: the reference that says what the hand-written one must do).
``config.engines.transport`` picks one (``upstream.make_client``).

The contract: ``post`` sends one request and returns once the response's status and headers are
in; the body is read as it arrives (``read_some``); the caller ends every response with exactly
one ``release`` (the connection goes back to the engine's keep-alive pool if the response was read
whole) or ``close`` (the connection is dropped: that is how vLLM learns to abort a request). No
Accept-Encoding is sent and nothing is decompressed: the bytes are relayed as the engine sent
them. Failures below HTTP raise ``ClientError`` subclasses, timeouts ``TimeoutError``
(``FirstTimeout`` for ``Timeouts.first``), and both are all a caller has to catch.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

# Response heads bigger than this are refused (HeadTooLarge): vLLM's are a few hundred bytes, and
# an engine sending more is broken, not talking. Header fields count name + value + 4 bytes each
# (": " and CRLF); the count is bounded too, so no implementation holds much while it parses.
MAX_HEAD_BYTES = 1 << 16
MAX_HEADERS = 128


class ClientError(Exception):
    """The exchange failed below HTTP: connection, framing or protocol."""


class ConnectError(ClientError):
    """No connection could be opened (refused, unresolvable, connect timeout, TLS failure)."""

    def __init__(self, message: str, os_error: OSError) -> None:
        super().__init__(message)
        self.os_error = os_error


class ServerDisconnected(ClientError):
    """The engine closed the connection before the response was complete."""


class ProtocolError(ClientError):
    """The engine's bytes are not a valid HTTP/1.1 response."""


class HeadTooLarge(ProtocolError):
    """The response head is over the client's size or header-count limit."""


class FirstTimeout(TimeoutError):
    """``Timeouts.first`` ran out before the caller called ``end_first``."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """``connect`` bounds opening a connection (TLS handshake included; running out is a
    ``ConnectError``); ``total`` the whole exchange, from the start of ``post`` to the last body
    byte; ``idle`` every wait for the next bytes (headers or body), measured from the start of
    that wait; ``first`` the exchange from the start of ``post`` (connecting included) until the
    caller calls ``end_first`` (e.g. the decode leg's first token), raising ``FirstTimeout``."""

    connect: float
    total: float | None = None
    idle: float | None = None
    first: float | None = None


class BodySink(Protocol):
    """Where ``EngineResponse.splice`` puts body bytes as they arrive (the client's connection).

    ``stopped`` turns true when the sink wants no more (a relay that found the stream broken):
    ``splice`` then returns without reading on, and the caller closes the connection."""

    stopped: bool

    def write(self, data: bytes) -> bool:
        """Take ``data``; False when the taker's buffer is full: call no more until ``drained``
        calls back."""
        ...

    def drained(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` once ``write`` may be called again (at once if it may now)."""
        ...


class EngineResponse(Protocol):
    """An engine's response whose status and headers are in; the body is read on demand."""

    status: int

    @property
    def content_length(self) -> int | None:
        """The Content-Length header, if the engine sent a valid one."""
        ...

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (given in lower case)."""
        ...

    async def read_some(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none has); b"" at the end."""
        ...

    async def read(self) -> bytes:
        """The whole (remaining) body."""
        ...

    async def splice(self, sink: BodySink) -> None:
        """Every remaining body byte into ``sink`` as it arrives, until the end or until the sink
        is ``stopped``; the same bytes and errors as ``read_some`` in a loop, without waking the
        caller per piece."""
        ...

    def end_first(self) -> None:
        """The part of the exchange ``Timeouts.first`` bounds is over."""
        ...

    def release(self) -> None:
        """Done with it: the connection is reused if the response was read whole, else dropped."""
        ...

    def close(self) -> None:
        """Drop the connection (the engine aborts an unfinished request)."""
        ...


class EngineTransport(Protocol):
    """POSTs to engines over per-engine keep-alive pools; outlives config versions."""

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> EngineResponse:
        """Send the request to ``base_url`` (``http(s)://host:port``) + ``path``; return once the
        status and headers are in. Cancelled or failed, the connection is dropped."""
        ...

    def close(self) -> None:
        """Close every connection, idle or in use (on the event loop, at shutdown)."""
        ...


async def read_whole(read_some: Callable[[], Awaitable[bytes]]) -> bytes:
    """Every ``read_some`` until b"": ``EngineResponse.read`` for both implementations."""
    parts = []
    while chunk := await read_some():
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def splice_by_reading(read_some: Callable[[], Awaitable[bytes]], sink: BodySink) -> None:
    """``EngineResponse.splice`` on ``read_some``: the reference behaviour."""
    while chunk := await read_some():
        if not sink.write(chunk) and not sink.stopped:
            await wait_drained(sink)
        if sink.stopped:
            return


async def wait_drained(sink: BodySink) -> None:
    """Until ``sink`` takes more (its ``drained`` callback)."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sink.drained(lambda: None if fut.done() else fut.set_result(None))
    await fut


def tls_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """The context for ``https://`` engines: verified against ``ca_file`` (else the system's CAs),
    presenting ``cert_file``/``key_file`` as the client certificate when given. One per client:
    building one reads the CA store, too slow to do per connection."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx
