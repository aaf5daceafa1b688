"""A streamed answer's body written straight onto the client's connection (the relay's fast path).

Relayed through ASGI, every chunk an engine streams costs a task wake-up, a message dict and
uvicorn's ``send`` coroutine on top of the two unavoidable system calls (read, write): most of the
gateway's CPU per chunk (docs/benchmarks.md, "Stream relay"). Instead the engine connection's
parser callback writes each piece onto the client's connection itself (after a migratable
stream's events are read and rewritten, synchronously, in the same callback):
``BodyWriter`` is that connection's side.

How the relay finds its connection: the guard (gateway/http/server.py) sets ``CONNECTION`` while
uvicorn's protocol handles the bytes that start a request, and uvicorn starts the request's ASGI
task right there, so the task's context (asyncio copies it at creation) holds the guard of the
connection it serves. Nothing a client sends can point it at another connection.

The writer frames each piece as a whole HTTP/1.1 chunk and writes it on the socket's transport.
The guard parses every byte uvicorn writes to see where each response ends; a whole chunk leaves
that parser where it was (between chunks), so the writer's chunks need not pass through it (two
Python calls and a parse less per chunk), and the response's head and last chunk still go through
uvicorn's ``send``, which the guard does see. It is offered only while the connection's current
response is a chunked one under way, and reports a full client buffer (``write`` False) so the
engine connection stops reading until ``drained`` calls back. A connection the guard cuts tells
its writer (``cut``), which writes nothing more.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Protocol

# The write buffer past which the engine connection is held back (uvicorn's own high-water mark
# for its transport's flow control is 64 KiB: the same bound).
HIGH_WATER = 1 << 16


class _Guard(Protocol):
    def body_writer(self) -> BodyWriter | None: ...


CONNECTION: contextvars.ContextVar[_Guard | None] = contextvars.ContextVar("pdgate_connection", default=None)


def body_writer() -> BodyWriter | None:
    """The writer for the response this task is sending, where its server offers one."""
    guard = CONNECTION.get()
    return guard.body_writer() if guard is not None else None


class BodyWriter:
    """Writes a chunked response's body pieces onto one connection (``transport.BodySink``)."""

    __slots__ = ("_cut", "_transport", "_waiting")

    def __init__(self, transport: Any) -> None:
        self._transport = transport  # the socket's transport: written directly, its buffer size
        self._cut = False  # the guard cut the connection
        self._waiting: Callable[[], None] | None = None

    def cut(self) -> None:
        """The guard cut the connection: nothing more may go out on it."""
        self._cut = True

    def write(self, data: bytes) -> bool:
        if not data:
            return True
        transport = self._transport
        if self._cut or transport.is_closing():
            return False  # the client is gone: hold the engine back until the exchange is cancelled
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))  # a whole chunk (see the module's doc)
        size: int = transport.get_write_buffer_size()
        return size <= HIGH_WATER

    def drained(self, resume: Callable[[], None]) -> None:
        if self._cut or self._transport.is_closing():
            return  # never: the exchange is cancelled when the client's departure is noticed
        if self._transport.get_write_buffer_size() <= HIGH_WATER:
            resume()
        else:
            self._waiting = resume

    def resume_writing(self) -> None:
        """The connection's buffer drained (the protocol's ``resume_writing``)."""
        resume, self._waiting = self._waiting, None
        if resume is not None:
            resume()
