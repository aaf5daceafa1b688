"""What only the H1Client does, beyond the contract every engine transport passes
(tests/gateway/test_transport.py, where its framing, keep-alive, limits and timeouts are tested
side by side with the aiohttp reference)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import uvloop

from gateway.engines import h1client, h1connection, transport
from gateway.engines.h1client import H1Client, Pool
from tests.gateway.test_transport import Exchange, Server, Sink, ok, post


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test on both loops: uvloop serves in production, its transports differ from asyncio's."""
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


def test_its_exceptions_are_the_interfaces_own():
    """Callers catch ``transport``'s exceptions; nothing here poses as aiohttp any more."""
    for name in (
        "ClientError",
        "ConnectError",
        "ServerDisconnected",
        "ProtocolError",
        "HeadTooLarge",
        "FirstTimeout",
        "Timeouts",
    ):
        assert getattr(h1client, name) is getattr(transport, name)
    assert not issubclass(h1client.ClientError, aiohttp.ClientError)
    assert not hasattr(h1client.Response, "headers") and not hasattr(h1client.Response, "content")


async def test_any_unasked_byte_on_an_idle_connection_retires_it():
    """Stricter than the contract (a whole unasked response): half a response is enough."""

    async def handler(ex: Exchange) -> None:
        await ex.answer(ok() + b"HTTP/1.1 200 OK\r\n")  # the start of one answer too many

    async with Server(handler) as server:
        client = H1Client()
        for _ in range(2):
            resp = await post(client, server)
            await resp.read()
            resp.release()
            await asyncio.sleep(0.05)
        assert server.connections == 2
        client.close()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing():
    """Past READ_HIGH_WATER unread bytes the connection stops reading until the reader catches up."""
    body = bytes(range(256)) * (3 * h1connection.READ_HIGH_WATER // 256)

    async def handler(ex: Exchange) -> None:
        await ex.answer(ok(body))

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        await asyncio.sleep(0.2)  # the engine sends it all; the client holds at most ~the high water
        assert resp._conn.buffered <= h1connection.READ_HIGH_WATER + (1 << 18)  # + one socket read
        got = await resp.read()
        assert got == body
        resp.release()
        assert server.connections == 1
        client.close()


async def test_a_connection_held_back_for_a_full_client_reads_again_once_pooled():
    """The engine's last bytes came in the read that filled the client's buffer: the answer is
    whole, so the connection goes back to the pool while held back for that client. The next
    request on it must be read at once, not wait for a drain that may never come (the first
    client is slow or gone): it used to wait out its first-byte timeout (600 s by default)."""
    go_on = asyncio.Event()
    answered = 0

    async def handler(ex: Exchange) -> None:
        nonlocal answered
        answered += 1
        if answered > 1:
            await ex.answer(ok(b"next"))
            return
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await go_on.wait()
        await ex.answer(b"7\r\ndata: 1\r\n7\r\ndata: 2\r\n0\r\n\r\n")  # the rest and the end, in one write

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, transport.Timeouts(connect=5, idle=10))
        sink = Sink(room=1)  # full after its first write, never drained
        task = asyncio.ensure_future(resp.splice(sink))
        await asyncio.sleep(0.02)
        go_on.set()
        await asyncio.wait_for(task, 5)  # whole: the splice is over though the sink is full
        assert b"".join(sink.got) == b"data: 1data: 2" and sink.resume is not None
        resp.release()
        again = await post(client, server, transport.Timeouts(connect=5, first=3))
        assert await asyncio.wait_for(again.read(), 3) == b"next"
        again.release()
        assert server.connections == 1  # the same connection, reused
        sink.release()  # the first client drains at last: nothing changes for the connection
        client.close()


def test_a_pool_takes_only_http_base_urls():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError):
            Pool("ftp://engine:21", 4.0, loop)
        assert Pool("http://engine", 4.0, loop).port == 80
        assert Pool("https://engine", 4.0, loop).ssl is not None
    finally:
        loop.close()
