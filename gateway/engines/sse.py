"""Server-sent events as engines frame them, by the WHATWG rules, where the gateway reads them.

vLLM writes every event as ``data: <json>`` and a blank line, and the readers' fast paths take
that shape as it comes. Anything else an HTTP hop in front of an engine may make of a stream is
read by the general rules rather than failing the stream: lines ending in CRLF or CR, comment
lines (``: keep-alive``, which some proxies inject), ``data:`` without its space, an event's data
over several ``data`` lines (joined by ``\\n``), and fields the gateway has no use for
(``event``, ``id``, ``retry``).
"""

from __future__ import annotations


def normalize(buf: bytes) -> bytes:
    """``buf`` with its CRLF and CR line ends made LF (only needed where ``b"\\r" in buf``). A
    ``\\r`` that ends a read may be half of a CRLF: a reader of pieces drops the LF that may begin
    the next one (``Events``)."""
    return buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def data(event: bytes) -> bytes | None:
    """The data of one event (its lines LF-separated, no blank line); None for an event that
    carries none (comments only, or other fields only)."""
    if event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event:  # vLLM's, all of them
        return event[6:]
    if b"\r" in event:  # line ends mixed within one event
        event = normalize(event)
    lines = []
    for line in event.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None


def payloads(buf: bytes, *, arriving: bool = False) -> list[bytes]:
    """The data of each whole event in ``buf`` (read from a stream's start) that carries data;
    with ``arriving``, also of the last one, still arriving. (A CR ending ``buf`` after a line
    end makes a blank line whatever follows it: such an event is whole.)"""
    if b"\r" in buf:
        buf = normalize(buf)
    parts = buf.split(b"\n\n")
    if not arriving:
        parts.pop()
    return [p for p in map(data, parts) if p is not None]


class Events:
    """Complete server-sent events out of bytes as they arrive: an event may span reads and a read
    may hold several (the migratable relay's reader, gateway/request/stitch.py). ``limit`` bounds
    the bytes one event may take while incomplete."""

    __slots__ = ("_buf", "_cr", "_limit", "oversized")

    def __init__(self, limit: int) -> None:
        self._buf = b""
        self._cr = False
        self._limit = limit
        self.oversized = False  # an incomplete event went past ``limit``: the stream is broken

    def feed(self, data: bytes) -> list[bytes]:
        """The events ``data`` completes (LF line ends, as ``normalize`` makes them). An incomplete
        one past ``limit`` ends the stream: ``oversized`` (the whole events before it are still
        returned, for the client to have)."""
        buf = self._buf + data if self._buf else data
        if buf.endswith(b"\n\n") and buf.count(b"\n\n") == 1 and not self._cr:
            self._buf = b""  # the usual read: one whole event (a CRLF one never ends so)
            return [buf[:-2]]
        if self._cr:  # the last read ended in CR, made LF: an LF now is the rest of its CRLF
            self._cr = False
            if data.startswith(b"\n"):
                buf = self._buf + data[1:]
        if b"\r" in buf:  # CRLF or CR line ends (a hop in front of the engine): made LF
            self._cr = buf.endswith(b"\r")
            buf = normalize(buf)
        parts = buf.split(b"\n\n")
        self._buf = parts.pop()
        if len(self._buf) > self._limit:
            self._buf = b""
            self.oversized = True
        return [p for p in parts if p.strip()]

    @property
    def idle(self) -> bool:
        """Nothing held: the next read starts an event."""
        return not self._buf and not self._cr

    def rest(self) -> bytes:
        """What is held of an incomplete event, given up (the reader stops splitting)."""
        rest, self._buf = self._buf, b""
        return rest
