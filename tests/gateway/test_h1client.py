"""What only the H1Client does, beyond the contract every engine transport passes
(tests/gateway/test_transport.py, where its framing, keep-alive, limits and timeouts are tested
side by side with the aiohttp reference)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import uvloop

from gateway.engines import h1client, transport
from gateway.engines.h1client import H1Client, Pool
from tests.gateway.test_transport import Exchange, Server, ok, post


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
    body = bytes(range(256)) * (3 * h1client.READ_HIGH_WATER // 256)

    async def handler(ex: Exchange) -> None:
        await ex.answer(ok(body))

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        await asyncio.sleep(0.2)  # the engine sends it all; the client holds at most ~the high water
        assert resp._conn.buffered <= h1client.READ_HIGH_WATER + (1 << 18)  # + one socket read
        got = await resp.read()
        assert got == body
        resp.release()
        assert server.connections == 1
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
