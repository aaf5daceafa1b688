"""uvicorn's httptools protocol, sending a response's head and body in one write.

uvicorn writes the status line and headers as soon as the app sends ``http.response.start`` and
the body on ``http.response.body``: two syscalls and two TCP segments per answer, and for a
non-streaming answer a client that may wake up twice. Here the head waits for the first body
write of the same loop iteration and goes out with it; if none comes (a stream whose first
chunk is still on its way), it goes out alone at the end of the iteration. Bytes are never
reordered: whatever is held is written before anything after it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1."


class HeadHoldingTransport:
    """A transport wrapper that holds a response head for the next write or the loop's next turn."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(_HEAD):
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:  # the rest of the transport interface, as is
        return getattr(self._transport, name)


class HeadHoldingProtocol(HttpToolsProtocol):
    """Pass as uvicorn's ``http`` protocol class."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, self.loop))  # type: ignore[arg-type]
