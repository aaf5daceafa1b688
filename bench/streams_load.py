"""The lean ends of ``bench.streams``: a streaming backend and a streaming load generator.

``backend`` is one uvloop process (httptools parsing, every stream on one timer heap) that answers
every chat request with ``tokens`` SSE chunks at ``rate`` tokens/s, each stream on its own phase;
it holds thousands of streams where the simulator's per-request tasks cannot. ``run_load`` opens
``n`` streams over ``ramp_s`` seconds from ``clients`` processes of raw asyncio connections and
reports errors, 429s, first-chunk latency, inter-chunk gaps and stream durations.
"""

from __future__ import annotations

import asyncio
import heapq
import multiprocessing
import time
from typing import Any

import httptools
import orjson
import uvloop

MODEL = "bench"

# ---------------------------------------------------------------------------------------- backend

_CHUNK = (
    b'data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n'
)
_LAST = (
    b'data: {"id":"chatcmpl-b","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
)
# Asked for return_token_ids (a migratable request through pdgate), as vLLM 0.32 sends them.
_CHUNK_IDS = _CHUNK.replace(b'"finish_reason":null}', b'"finish_reason":null,"token_ids":[1337]}')
_LAST_IDS = _LAST.replace(b'"finish_reason":"length"}', b'"finish_reason":"length","stop_reason":null,"token_ids":[7]}')

_WHOLE = orjson.dumps(
    {
        "id": "chatcmpl-b",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Backend(asyncio.Protocol):
    """One connection of the lean backend: /health, /v1/models, and chat streams on the heap."""

    def __init__(self, streams: list[Any], interval: float, tokens: int) -> None:
        self._streams, self._interval, self._tokens = streams, interval, tokens
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body += body

    def _reply(self, status: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 "
            + status
            + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    def on_message_complete(self) -> None:
        url, body = self._url, bytes(self._body)
        self._url, self._body = b"", bytearray()
        if url == b"/health":
            self._reply(b"200 OK", b"{}")
        elif url == b"/v1/models":
            self._reply(b"200 OK", orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif url.startswith(b"/v1/chat/completions"):
            req = orjson.loads(body)
            tokens = int(req.get("max_tokens") or self._tokens)
            if not req.get("stream"):  # an instant whole answer
                self._reply(b"200 OK", _WHOLE)
                return
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            chunks = (_CHUNK_IDS, _LAST_IDS) if req.get("return_token_ids") else (_CHUNK, _LAST)
            heapq.heappush(self._streams, (time.monotonic() + self._interval, id(self), self, tokens, chunks))
        else:
            self._reply(b"404 Not Found", b'{"error":{"message":"not found"}}')


async def _tick(streams: list[Any], interval: float) -> None:
    """Every due stream gets its next chunk; each keeps its own phase."""
    while True:
        now = time.monotonic()
        while streams and streams[0][0] <= now:
            due, key, conn, left, chunks = heapq.heappop(streams)
            t = conn.transport
            if t is None or t.is_closing():
                continue
            if left <= 1:
                t.write(_chunked(chunks[1]) + b"0\r\n\r\n")
            else:
                t.write(_chunked(chunks[0]))
                heapq.heappush(streams, (due + interval, key, conn, left - 1, chunks))
        await asyncio.sleep(min(0.001, max(0.0, streams[0][0] - time.monotonic())) if streams else 0.001)


def backend(port: int, rate: float, tokens: int) -> None:
    async def main() -> None:
        streams: list[Any] = []
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Backend(streams, 1.0 / rate, tokens), "127.0.0.1", port, backlog=8192
        )
        async with server:
            await _tick(streams, 1.0 / rate)

    uvloop.run(main())


# ----------------------------------------------------------------------------------------- client


class _Stream(asyncio.Protocol):
    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self._request, self._done = request, done
        self.sent = 0.0
        self.first = 0.0
        self.last = 0.0
        self.events = 0
        self.gaps: list[float] = []
        self.status = 0
        self._head = b""
        self.ended = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.sent = time.monotonic()
        transport.write(self._request)  # type: ignore[attr-defined]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.status:
            self._head += data
            if b"\r\n\r\n" not in self._head:
                return
            head, _, data = self._head.partition(b"\r\n\r\n")
            self.status = int(head.split(b" ", 2)[1])
            if self.status != 200:
                self.transport.close()  # type: ignore[attr-defined]
                return
        n = data.count(b"data: ")
        if n:
            if self.events == 0:
                self.first = now - self.sent
            else:
                self.gaps.append(now - self.last)
                self.gaps.extend([0.0] * (n - 1))
            self.events += n
            self.last = now
        if b"data: [DONE]" in data:
            self.ended = now
            self.transport.close()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)


def _client(
    host_port: tuple[str, int], path: str, n: int, ramp_s: float, tokens: int, timeout_s: float, out: Any
) -> None:
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "stream please"}],
        }
    )
    request = (
        f"POST {path} HTTP/1.1\r\nhost: {host_port[0]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        streams: list[_Stream] = []
        errors = refused = 0

        async def one(delay: float) -> None:
            nonlocal errors, refused
            await asyncio.sleep(delay)
            done: asyncio.Future[None] = loop.create_future()
            s = _Stream(request, done)
            try:
                await loop.create_connection(lambda: s, *host_port)
                await asyncio.wait_for(done, timeout_s)
            except (OSError, TimeoutError):
                errors += 1
                return
            if s.status == 429:  # admission said no, at once: a clear answer, not an error
                refused += 1
                return
            if s.status != 200 or not s.ended:
                errors += 1
            streams.append(s)

        await asyncio.gather(*(one(ramp_s * i / max(1, n)) for i in range(n)))
        ok = [s for s in streams if s.ended and s.status == 200]
        return {
            "errors": errors + len(streams) - len(ok),
            "refused": refused,
            "first": [s.first for s in ok],
            "gaps": [g for s in ok for g in s.gaps],
            "durations": [s.ended - s.sent for s in ok],
        }

    out.put(uvloop.run(main()))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


def run_load(url: str, n: int, clients: int, ramp_s: float, tokens: int, rate: float) -> dict[str, Any]:
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    timeout_s = ramp_s + tokens / rate * 4 + 30
    procs = [
        ctx.Process(
            target=_client,
            args=(
                (host, int(port)),
                "/v1/chat/completions",
                n // clients + (1 if i < n % clients else 0),
                ramp_s,
                tokens,
                timeout_s,
                out,
            ),
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    parts = [out.get(timeout=timeout_s + 30) for _ in procs]
    for p in procs:
        p.join(10)
    first = [x for r in parts for x in r["first"]]
    gaps = [x for r in parts for x in r["gaps"]]
    durations = [x for r in parts for x in r["durations"]]
    return {
        "streams": n,
        "errors": sum(r["errors"] for r in parts),
        "refused_429": sum(r["refused"] for r in parts),
        "first_chunk_p50_ms": _pct(first, 0.5),
        "first_chunk_p99_ms": _pct(first, 0.99),
        "gap_p50_ms": _pct(gaps, 0.5),
        "gap_p99_ms": _pct(gaps, 0.99),
        "duration_p50_s": round(sorted(durations)[len(durations) // 2], 2) if durations else None,
        "ideal_duration_s": round(tokens / rate, 2),
    }
