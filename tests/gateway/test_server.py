"""The guard in front of uvicorn's protocol (gateway/http/server.py): what one client can make the
server hold, before a request reaches the app and after. A real uvicorn server on loopback, raw
sockets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import uvicorn

from gateway.fairness.admission import LoopLag
from gateway.http.connections import SMOOTHING, Connections, Limits
from gateway.http.server import BODY_GRACE_S, LINGER_S, guarded_protocol
from gateway.http.uvicorn_server import quiet_upgrades

LIMITS = Limits(
    max_head_bytes=4096,
    max_headers=20,
    head_timeout_s=0.5,
    max_connections=8,
    body_timeout_s=3.0,
    body_idle_timeout_s=0.5,
    stall_timeout_s=0.5,
)
KEEP_ALIVE_S = 1.0
FLOOD = 16 << 20  # /flood's answer: more than any socket buffers between it and the client hold
flooded: list[int] = []  # what each /flood answer wrote before it ended
BIG = 4 << 20
LATE_S = 2.0  # /hang answers this late: past the guard's body idle bound (0.5 s + the grace), within its linger


async def respond(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send) -> None:
    """``/early``: 200 without reading the body; ``/denied``: 401 without reading it (an auth
    failure); ``/hang``: neither reads nor answers for ``LATE_S``; ``/slowread``: reads after 2 s;
    ``/stream``: 20 chunks over 2 s; ``/flood``: ``FLOOD`` bytes as fast as the client takes them;
    ``/big``: a whole ``BIG``-byte answer in one write;
    anything else: reads the body and says its length."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/early":
        return await respond(send, 200, b"early")
    if path == "/denied":
        return await respond(send, 401, b"no key")
    if path == "/hang":
        await asyncio.sleep(LATE_S)
        return await respond(send, 200, b"late")
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(20):
            await asyncio.sleep(0.1)
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
        return await send({"type": "http.response.body", "body": b""})
    if path == "/flood":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        piece, sent = b"x" * (1 << 16), 0
        while sent < FLOOD:  # uvicorn's send waits while the client's buffer is full
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent += len(piece)
        flooded.append(sent)
        return await send({"type": "http.response.body", "body": b""})
    if path == "/big":
        return await respond(send, 200, b"b" * BIG)
    if path == "/slowread":
        await asyncio.sleep(2.0)
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await respond(send, 200, b"ok " + str(len(body)).encode())


@contextlib.asynccontextmanager
async def server(limits: Limits = LIMITS, writes: list[bytes] | None = None) -> AsyncIterator[tuple[int, Connections]]:
    """The guarded server; with ``writes``, every write onto a client's socket is noted there."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    connections = Connections(limits.max_connections)
    protocol = guarded_protocol(limits, connections)
    if writes is not None:
        protocol = _counting(protocol, writes)
    # as gateway/http/uvicorn_server.py's make_server: no WebSockets, uvicorn's upgrade warnings dropped
    config = uvicorn.Config(
        app,
        http=protocol,
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        ws="none",
    )
    quiet_upgrades()
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not srv.started:  # noqa: ASYNC110 - uvicorn has no readiness event
            await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], connections
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


class _NotedWrites:
    """A socket's transport whose writes are noted (each is one ``write`` system call)."""

    def __init__(self, transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _counting(protocol: type, writes: list[bytes]) -> type:
    class Counting(protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(_NotedWrites(transport, writes))

    return Counting


async def read_all(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5):
        return await reader.read()


def status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)["error"] if body.startswith(b"{") else {}


async def test_plain_requests_pass_on_one_connection():
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for n in (0, 5):
            writer.write(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % n + b"z" * n)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(len(b"ok %d" % n)) == b"ok %d" % n
        writer.close()


async def test_an_endless_header_is_cut_off_at_the_limit():
    """Reproduction of issue 13's first finding: the header never ends; the answer is a 431 as soon
    as the head passes the limit, on any route, while the client is still sending."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-E: ")
        stop = asyncio.Event()

        async def keep_sending() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                while not stop.is_set():
                    writer.write(b"a" * 65536)
                    await writer.drain()

        sender = asyncio.create_task(keep_sending())
        raw = await read_all(reader)  # the answer, then the server's half-close
        assert not sender.done()  # answered mid-stream, not after the client gave up
        stop.set()
        await sender
        status, error = status_and_error(raw)
        assert (status, error["code"]) == (431, "headers_too_large")


async def test_too_many_headers_get_431():
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(30)) + b"\r\n")
        assert status_and_error(await read_all(reader))[0] == 431


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /x HT", b"GET /x HTTP/1.1\r\nHost: a\r\n"],
    ids=["nothing", "half-a-request-line", "unterminated-headers"],
)
async def test_a_head_that_does_not_arrive_in_time_gets_408(sent):
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        raw = await read_all(reader)  # returns: the server closed the connection
        status, error = status_and_error(raw)
        assert (status, error["code"]) == (408, "request_timeout")


async def test_malformed_http_gets_an_openai_shaped_400():
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost a\r\n\r\n")
        status, error = status_and_error(await read_all(reader))
        assert (status, error["code"], error["type"]) == (400, "invalid_http", "invalid_request_error")


async def test_connections_past_the_cap_are_refused_with_a_log_line(caplog):
    limits = Limits(max_head_bytes=4096, max_headers=20, head_timeout_s=5, max_connections=3)
    async with server(limits) as (port, connections):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        async with asyncio.timeout(5):
            while connections.open < 3:  # noqa: ASYNC110 - the server accepts them on its own time
                await asyncio.sleep(0.01)
        with caplog.at_level(logging.WARNING):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            status, error = status_and_error(await read_all(reader))
        assert (status, error["code"]) == (503, "too_many_connections")
        assert connections.refused == 1 and any("max_connections" in r.message for r in caplog.records)
        for _, w in held:
            w.close()
        async with asyncio.timeout(5):
            while connections.open:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # room again
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert (await read_all(reader)).startswith(b"HTTP/1.1 200")


async def test_a_slow_but_steady_head_still_counts_from_its_first_byte():
    """Slowloris: a byte now and then never completes the head within the timeout."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                for byte in b"GET /x HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"z" * 1000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.02)

        sender = asyncio.create_task(trickle())
        raw = await read_all(reader)
        assert not sender.done()  # cut off while still trickling
        sender.cancel()
        assert status_and_error(raw)[0] == 408


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="TCP_INFO is Linux's")
async def test_a_new_connections_wait_before_it_is_read_is_measured():
    """A busy server reads a new connection's request late; the guard notes how late (the
    kernel's time since the bytes arrived), which admission sheds on (gateway/fairness/admission.py)."""
    async with server() as (port, connections):
        sent = threading.Event()

        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
                sent.set()
                return s.recv(1024)

        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client)
            assert sent.wait(5)
            time.sleep(0.3)  # noqa: ASYNC251 - the server's loop is busy: the request waits in the kernel
            assert (await asyncio.wrap_future(answer)).startswith(b"HTTP/1.1 200")
        # one sample, weighted as one among several (a single hiccup does not shed requests)
        assert 0.25 * SMOOTHING <= connections.wait_s <= 0.6 * SMOOTHING
        lag = LoopLag(connections=connections)
        assert lag.over(50) and not lag.over(500)
        for _ in range(10):
            lag.note(0.0)  # ticks with no new connection: the wait fades
        assert not lag.over(50)


# -- after the head: the body, the answer, and what comes after it (issue 27) ------------------------


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response framed by its content-length (the test app's non-streaming ones)."""
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines[1:])}
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return int(lines[0].split(b" ", 2)[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    """Whether the server ends the connection (EOF or reset) within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def all_gone(connections: Connections) -> None:
    async with asyncio.timeout(5):
        while connections.open:  # noqa: ASYNC110 - the guard closes them on its own time
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("route", ["/early", "/denied"])
async def test_an_answer_before_the_body_closes_the_connection(route):
    """Issue 27's attack: a head that declares a body, on a route that answers without reading it;
    the client reads the answer, sends a byte of the body and stays idle. The byte used to cancel
    uvicorn's keep-alive timer with no other timer running: the connection was held for good."""
    async with server() as (port, connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc" % route.encode())
        status, headers, _ = await read_response(reader)
        assert status == (200 if route == "/early" else 401)
        assert headers[b"connection"] == b"close"  # the client knows not to send its next request here
        writer.write(b"d")
        assert await closed_by_server(reader, LINGER_S + 3)
        await all_gone(connections)
        writer.close()


async def test_a_401_closes_the_connection_even_after_a_whole_request():
    """Who has no key holds nothing after the answer (no keep-alive)."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /denied HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        status, headers, _ = await read_response(reader)
        assert (status, headers[b"connection"]) == (401, b"close")
        assert await closed_by_server(reader, LINGER_S + 3)
        writer.close()


async def test_a_body_nobody_reads_is_cut_by_the_guard_with_a_408(caplog):
    """A route that neither reads the body nor answers (yet): the body stalls after one byte; the
    guard answers 408 past the body idle bound and closes, and the app's late answer is dropped
    without an error."""
    async with server() as (port, connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with caplog.at_level(logging.ERROR):
            writer.write(b"POST /hang HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n{")
            started = time.monotonic()
            raw = await read_all(reader)  # the 408, then the half-close
            took = time.monotonic() - started
            status, error = status_and_error(raw)
            assert (status, error["code"]) == (408, "request_timeout")
            assert took >= LIMITS.body_idle_timeout_s + BODY_GRACE_S - 0.05  # the bound and its grace, not sooner
            await all_gone(connections)
            await asyncio.sleep(LATE_S - took + 0.2)  # the app answers now: nothing to answer on
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        writer.close()


async def test_a_body_that_keeps_trickling_is_cut_at_the_whole_deadline():
    """A byte at a time, each within the idle bound: the whole-body deadline ends it (this app has
    no read timeouts of its own: the guard's are the only ones)."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n")  # read as it comes

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                while True:  # each byte within the idle bound: only the whole deadline ends it
                    await asyncio.sleep(0.2)
                    writer.write(b"z")
                    await writer.drain()

        sender = asyncio.create_task(trickle())
        started = time.monotonic()
        raw = await read_all(reader)
        assert not sender.done()  # cut off while still trickling
        sender.cancel()
        assert status_and_error(raw)[0] == 408
        assert time.monotonic() - started >= LIMITS.body_timeout_s + BODY_GRACE_S - 0.05
        writer.close()


async def test_a_slow_upload_within_the_bounds_is_read_whole_and_the_connection_kept():
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 20\r\n\r\n")
        for _ in range(5):  # 2 s in all, within the body timeout; 0.4 s gaps, within the idle bound
            await asyncio.sleep(0.4)
            writer.write(b"abcd")
        status, headers, body = await read_response(reader)
        assert (status, body) == (200, b"ok 20") and b"connection" not in headers
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")  # the same connection serves the next one
        assert (await read_response(reader))[2] == b"ok 0"
        writer.close()


async def test_a_body_held_back_by_an_app_that_reads_late_is_not_cut():
    """uvicorn stops reading past 64 KiB the app has not taken: the client cannot send meanwhile,
    so that wait is not the body's (here 2 s, past the idle bound)."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        size = 1 << 20
        writer.write(b"POST /slowread HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % size + b"z" * size)
        status, _, body = await read_response(reader)
        assert (status, body) == (200, b"ok %d" % size)
        writer.close()


async def test_a_stream_outlives_every_connection_bound():
    """20 chunks over 2 s, past the head, body idle and keep-alive bounds: whole, and the
    connection serves the next request."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
        async with asyncio.timeout(10):
            got = await reader.readuntil(b"\r\n0\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200") and got.count(b"chunk ") == 20
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (await read_response(reader))[2] == b"ok 0"
        writer.close()


async def test_an_idle_connection_between_requests_is_closed_after_the_keep_alive_timeout():
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        await read_response(reader)
        assert await closed_by_server(reader, KEEP_ALIVE_S + 3)
        writer.close()


async def test_pipelined_requests_a_head_and_expect_continue_keep_their_framing():
    """The guard frames uvicorn's answers to decide when one is whole: a HEAD's answer (a length, no
    body), a 100 Continue and pipelined answers must not throw it off. The proof: an early answer
    after them still closes the connection, and the ones before do not."""
    async with server() as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /x HTTP/1.1\r\nHost: a\r\n\r\nHEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
        )
        assert (await read_response(reader))[2] == b"ok 0"
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")  # HEAD: a content-length, and no body
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: 4" in head
        assert (await read_response(reader))[2] == b"ok 3"
        writer.write(b"POST /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        writer.write(b"hello")
        status, headers, body = await read_response(reader)
        assert (status, body) == (200, b"ok 5") and b"connection" not in headers
        writer.write(b"POST /early HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert (status, headers[b"connection"]) == (200, b"close")
        assert await closed_by_server(reader, LINGER_S + 3)
        writer.close()


async def test_an_upgrade_request_is_answered_as_http_and_closes_the_connection(caplog):
    """No WebSockets: uvicorn's upgrade would hand the socket to another protocol behind the
    guard's back (its connection never left the count). The request is answered as plain HTTP,
    what the client sends after it is dropped, the connection closes, and nothing is logged."""
    async with server() as (port, connections):
        with caplog.at_level(logging.WARNING):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            status, headers, body = await read_response(reader)
            assert (status, body, headers[b"connection"]) == (200, b"ok 0", b"close")
            writer.write(b"\x81\x05hello")  # a WebSocket frame: nobody here reads it
            assert await closed_by_server(reader, LINGER_S + 3)
            await all_gone(connections)
            writer.close()
        assert not [r for r in caplog.records if r.name.startswith("uvicorn")]


async def test_a_whole_answer_leaves_in_one_write_and_a_streams_head_does_not_wait_for_its_body():
    writes: list[bytes] = []
    async with server(writes=writes) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /early HTTP/1.1\r\nhost: x\r\n\r\n")
        async with asyncio.timeout(5):
            await reader.readuntil(b"early")
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"early")
        writes.clear()
        writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")  # its first chunk comes 0.1 s later
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readuntil(b"0\r\n\r\n")
        writer.close()
    assert head.startswith(b"HTTP/1.1 200") and writes[0] == head  # the head went out alone, at once
    assert b"chunk 0" in writes[1] and b"chunk 19" in b"".join(writes)


async def _flood(
    port: int, read_every_s: float | None, *, path: bytes = b"/flood", read_max: int = 1 << 20, then: bytes = b""
) -> tuple[int, float, bool]:
    """GET ``path`` through a small receive window, reading (up to ``read_max`` of what is
    there) every ``read_every_s`` or, with None, every 5 s (long after the stall bound; after
    sending ``then``): the bytes got, the seconds it took, and whether the answer was whole."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    started, got, whole = loop.time(), 0, False
    try:
        await loop.sock_sendall(sock, b"GET %s HTTP/1.1\r\nHost: a\r\n\r\n" % path)
        if then:
            await asyncio.sleep(0.2)  # the answer under way, its buffer full
            await loop.sock_sendall(sock, then)
        async with asyncio.timeout(30):
            while True:
                await asyncio.sleep(read_every_s if read_every_s is not None else 5.0)
                try:
                    took = 0
                    while took < read_max:  # what has arrived, without waiting
                        more = sock.recv(min(1 << 20, read_max - took))
                        if not more:
                            return got, loop.time() - started, whole
                        got += len(more)
                        took += len(more)
                        whole = whole or more.endswith(b"\r\n0\r\n\r\n") or (path == b"/big" and got >= BIG + 40)
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    return got, loop.time() - started, whole
                if whole and path == b"/big":
                    return got, loop.time() - started, whole
    finally:
        sock.close()


async def test_a_client_that_leaves_its_answer_unread_is_disconnected_and_the_app_told():
    """A stream nobody reads holds an engine request and an admission slot: past
    ``stall_timeout_s`` with its buffer full the guard drops the connection, and the app's
    sends stop waiting (uvicorn's protocol sees the connection lost)."""
    flooded.clear()
    async with server() as (port, connections):
        got, took, whole = await _flood(port, None)
        assert not whole and got < FLOOD // 4
        assert took < 15
        assert connections.stalled == 1
        async with asyncio.timeout(10):
            while not flooded:  # noqa: ASYNC110 - the app's loop ends once its sends stop waiting
                await asyncio.sleep(0.05)


async def test_a_slow_reader_that_keeps_reading_is_not_disconnected():
    """Reading in bursts, each well within the stall bound, the whole answer arrives."""
    async with server(dataclasses.replace(LIMITS, stall_timeout_s=2.0)) as (port, connections):
        got, _, whole = await _flood(port, 0.02)
        assert whole and got > FLOOD
        assert connections.stalled == 0


async def test_a_big_whole_answer_read_slowly_is_not_cut_while_the_client_takes_some():
    """A 4 MiB answer leaves in one write and stays above the high-water mark for seconds at
    256 KiB per 0.1 s: the bound is about a client taking nothing, not about a full buffer."""
    async with server(dataclasses.replace(LIMITS, stall_timeout_s=0.3)) as (port, connections):
        _, took, whole = await _flood(port, 0.1, path=b"/big", read_max=256 << 10)
        assert whole and took > 0.6  # several stall periods long
        assert connections.stalled == 0


async def test_a_connection_the_guard_cut_is_still_reset_when_its_client_reads_nothing():
    """Bytes after a stream's request that are not HTTP make the guard cut the connection (no
    answer of its own, the stream's head is out); its close then waits for a buffer the client
    never reads: the stall bound ends it, and the app's sends stop waiting."""
    flooded.clear()
    async with server() as (port, connections):
        _, took, whole = await _flood(port, None, then=b"\x00not http\r\n\r\n")
        assert not whole and took < 15
        assert connections.stalled == 1
        async with asyncio.timeout(10):
            while not flooded:  # noqa: ASYNC110 - the app's loop ends once its sends stop waiting
                await asyncio.sleep(0.05)
