"""The guard in front of uvicorn's protocol (gateway/httpserver.py): what one client can make the
server hold before a request reaches the app. A real uvicorn server on loopback, raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import uvicorn

from gateway.admission import LoopLag
from gateway.httpserver import SMOOTHING, Connections, Limits, guarded_protocol

LIMITS = Limits(max_head_bytes=4096, max_headers=20, head_timeout_s=0.5, max_connections=8)


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = b"ok " + str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@contextlib.asynccontextmanager
async def server(limits: Limits = LIMITS) -> AsyncIterator[tuple[int, Connections]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    connections = Connections(limits.max_connections)
    config = uvicorn.Config(app, http=guarded_protocol(limits, connections), lifespan="off", log_level="warning",
                            timeout_keep_alive=5)
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


@pytest.mark.parametrize("sent", [b"", b"GET /x HT", b"GET /x HTTP/1.1\r\nHost: a\r\n"],
                         ids=["nothing", "half-a-request-line", "unterminated-headers"])
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
    kernel's time since the bytes arrived), which admission sheds on (gateway/admission.py)."""
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
