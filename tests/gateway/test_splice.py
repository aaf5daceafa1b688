"""gateway/http/splice.py: a streamed body written straight onto the client's connection, on a real
uvicorn server behind the guard. The client sees one well-framed HTTP/1.1 response (the connection
is reused after it), a full client buffer holds the writer back until it drains, and the writer is
offered only to the request's own task, only while its chunked response is under way."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn

from gateway.http import splice
from gateway.http.connections import Connections, Limits
from gateway.http.server import guarded_protocol
from gateway.http.uvicorn_server import quiet_upgrades

LIMITS = Limits(max_head_bytes=4096, max_headers=20, head_timeout_s=2.0, max_connections=8)
seen: dict[str, Any] = {}


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    seen[path + ":before"] = splice.body_writer()  # nothing started yet: none
    if path == "/whole":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        seen[path] = splice.body_writer()  # framed by its length: none
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
    writer = seen[path] = splice.body_writer()
    assert writer is not None
    if path == "/stream":
        for i in range(5):
            await asyncio.sleep(0.01)
            assert writer.write(b"data: %d\n\n" % i)
    elif path == "/flood":  # far more than the client buffer holds while the client does not read
        writes, full = 0, asyncio.Event()
        while writer.write(b"x" * 65536):
            writes += 1
        seen["flood_writes"] = writes + 1
        writer.drained(full.set)
        seen["held"] = not full.is_set()
        async with asyncio.timeout(10):
            await full.wait()  # the client reads: drained calls back
        seen["drained"] = True
    elif path == "/cut":  # the client pipelines a request over the head limits: the guard cuts
        async with asyncio.timeout(5):
            while writer.write(b"data: tick\n\n"):  # noqa: ASYNC110 - a tick per write, not a wait
                await asyncio.sleep(0.01)
        seen["after_cut"] = writer.write(b"data: late\n\n")
        return
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    seen[path + ":after"] = splice.body_writer()  # the response is whole: none


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[tuple[str, Connections]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    connections = Connections(LIMITS.max_connections)
    config = uvicorn.Config(
        app, http=guarded_protocol(LIMITS, connections), lifespan="off", log_level="warning", ws="none"
    )
    quiet_upgrades()
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not srv.started:  # noqa: ASYNC110 - uvicorn has no readiness event
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", connections
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_a_spliced_body_arrives_whole_and_framed_and_the_connection_is_reused() -> None:
    seen.clear()
    async with server() as (url, connections), httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
        r = await client.get(url + "/stream")
        assert r.status_code == 200
        assert r.text == "data: first\n\n" + "".join(f"data: {i}\n\n" for i in range(5)) + "data: [DONE]\n\n"
        r = await client.get(url + "/whole")  # the same connection: the chunked framing ended right
        assert r.text == "ok" and connections.open == 1
    assert seen["/stream:before"] is None and seen["/stream:after"] is None
    assert seen["/whole:before"] is None and seen["/whole"] is None


async def test_a_client_that_does_not_read_holds_the_writer_back_until_it_drains() -> None:
    seen.clear()
    async with server() as (url, _), httpx.AsyncClient(timeout=20) as client:
        async with client.stream("GET", url + "/flood") as r:
            await asyncio.sleep(0.3)  # not reading: the server's buffer fills
            assert seen.get("held") is True and "drained" not in seen
            body = b"".join([chunk async for chunk in r.aiter_bytes()])
        assert body.endswith(b"data: [DONE]\n\n")
        assert body.count(b"x") == seen["flood_writes"] * 65536
    assert seen["drained"] is True


async def test_no_writer_outside_a_request_of_the_guarded_server() -> None:
    assert splice.body_writer() is None


async def test_a_connection_the_guard_cuts_takes_no_more_from_the_writer() -> None:
    seen.clear()
    async with server() as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /cut HTTP/1.1\r\nhost: x\r\n\r\n")
        got = await reader.readuntil(b"data: tick\n\n")
        writer.write(b"GET /next HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
        async with asyncio.timeout(10):
            got += await reader.read()  # until the guard ends its side of the connection
            while "after_cut" not in seen:  # noqa: ASYNC110 - the client keeps its side open meanwhile
                await asyncio.sleep(0.01)
        writer.close()
    assert seen["after_cut"] is False
    assert b"late" not in got and b"431" not in got  # no answer inside the stream under way
