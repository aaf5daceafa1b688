"""The engine-leg HTTP client against scripted loopback servers: framing, keep-alive, aborts,
timeouts, and the Upstream's error mapping on top of it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import pytest
import uvloop

from gateway.config import TimeoutsConfig
from gateway.h1client import FirstTimeout, H1Client, ProtocolError, ServerDisconnected, Timeouts
from gateway.pools import Endpoint
from gateway.upstream import MAX_JSON_BYTES, EngineError, Upstream
from tests.procs import free_port

Handler = Callable[["Exchange"], Awaitable[None]]
T = Timeouts(connect=5, total=10)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every test on both loops: uvloop serves in production, its transports differ from asyncio's."""
    return uvloop.EventLoopPolicy() if request.param == "uvloop" else asyncio.DefaultEventLoopPolicy()


class Exchange:
    """One request as the server saw it, and the means to answer it."""

    def __init__(self, head: bytes, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.head = head
        self.body = body
        self.reader = reader
        self.writer = writer

    def header(self, name: str) -> str | None:
        for line in self.head.decode().split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None

    async def answer(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


class Server:
    """A loopback HTTP/1.1 server whose every request goes to ``handler``; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.exchanges: list[Exchange] = []

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client.set()
                    return
                ex = Exchange(head, b"", reader, writer)
                ex.body = await reader.readexactly(int(ex.header("content-length") or 0))
                self.exchanges.append(ex)
                await self.handler(ex)
        except ConnectionError:
            self.closed_by_client.set()
        finally:
            writer.close()


async def post(client: H1Client, server: Server, timeouts: Timeouts = T, body: bytes = b'{"a": 1}'):
    return await client.post(server.url, "/v1/completions", body, {"Content-Type": "application/json",
                                                                  "X-Request-Id": "req-1"}, timeouts)


async def test_request_bytes_and_content_length_response():
    async def handler(ex: Exchange) -> None:
        await ex.answer(ok(b'{"answer": 42}', b"X-Extra: yes\r\n"))

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        assert resp.status == 200
        assert resp.header(b"x-extra") == b"yes" and resp.content_length == 14
        assert await resp.read() == b'{"answer": 42}'
        resp.release()
        [ex] = server.exchanges
        assert ex.head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert ex.header("host") == server.url.removeprefix("http://")
        assert ex.header("x-request-id") == "req-1" and ex.header("content-type") == "application/json"
        assert ex.header("accept-encoding") is None  # bytes are relayed as sent: none may be compressed
        assert ex.body == b'{"a": 1}'
        client.close()


async def test_keep_alive_reuses_a_connection_only_after_a_whole_response():
    rest = asyncio.Event()

    async def handler(ex: Exchange) -> None:
        whole = ok(b"x" * 100)
        await ex.answer(whole[:-50])
        await rest.wait()
        await ex.answer(whole[-50:])

    async with Server(handler) as server:
        client = H1Client()
        rest.set()
        for _ in range(3):
            resp = await post(client, server)
            assert await resp.read() == b"x" * 100
            resp.release()
        assert server.connections == 1
        rest.clear()
        resp = await post(client, server)
        resp.release()  # half read: the rest would come on this connection, so no reuse
        rest.set()
        resp = await post(client, server)
        assert await resp.read() == b"x" * 100
        resp.release()
        assert server.connections == 2
        client.close()


async def test_chunked_body_is_handed_over_as_it_arrives():
    go_on = asyncio.Event()

    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"7\r\ndata: 1\r\n")
        await go_on.wait()
        await ex.answer(b"7\r\ndata: 2\r\n0\r\n\r\n")

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, Timeouts(connect=5, idle=10))
        assert resp.header(b"content-type") == b"text/event-stream"
        assert await resp.read_some() == b"data: 1"  # before the engine sent the rest
        go_on.set()
        assert await resp.read() == b"data: 2"
        assert await resp.read_some() == b""
        resp.release()
        resp = await post(client, server)  # the chunked response ended cleanly: same connection
        go_on.set()
        assert await resp.read() == b"data: 1data: 2"
        resp.release()
        assert server.connections == 1
        client.close()


async def test_the_aiohttp_calls_callers_may_still_make():
    go_on = asyncio.Event()

    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"1\r\na\r\n")
        await go_on.wait()
        await ex.answer(b"1\r\nb\r\n0\r\n\r\n")

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        assert resp.headers.get("Content-Type") == "text/event-stream"
        assert await resp.content.readany() == b"a"
        go_on.set()
        assert [chunk async for chunk in resp.content.iter_any()] == [b"b"]
        resp.release()
        client.close()
    assert issubclass(ServerDisconnected, aiohttp.ClientError)


async def test_body_ended_by_connection_close():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"long\": ")
        await ex.answer(b"true}")
        ex.writer.close()

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        assert await resp.read() == b'{"long": true}'
        resp.release()
        resp = await post(client, server)
        assert await resp.read() == b'{"long": true}'
        resp.release()
        assert server.connections == 2
        client.close()


async def test_closing_a_response_drops_the_connection_so_the_engine_can_abort():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await ex.reader.read()  # the stream goes on until the client leaves

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, Timeouts(connect=5, idle=10))
        assert await resp.read_some() == b"first"
        resp.close()
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
        client.close()


async def test_cancelling_while_waiting_for_the_answer_drops_the_connection():
    asked = asyncio.Event()

    async def handler(ex: Exchange) -> None:
        asked.set()
        await ex.reader.read()  # never answers

    async with Server(handler) as server:
        client = H1Client()
        task = asyncio.ensure_future(post(client, server))
        await asyncio.wait_for(asked.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
        client.close()


async def test_idle_connections_are_dropped_after_the_keepalive_time():
    async def handler(ex: Exchange) -> None:
        await ex.answer(ok())

    async with Server(handler) as server:
        client = H1Client(keepalive_s=0.05)
        resp = await post(client, server)
        await resp.read()
        resp.release()
        await asyncio.wait_for(server.closed_by_client.wait(), 10)  # closed by us, before the engine would
        resp = await post(client, server)
        await resp.read()
        resp.release()
        assert server.connections == 2
        client.close()


async def test_silence_past_the_idle_timeout():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await ex.reader.read()

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, Timeouts(connect=5, idle=0.05))
        assert await resp.read_some() == b"hi"
        with pytest.raises(TimeoutError):
            await resp.read_some()
        resp.close()
        client.close()


async def test_a_stream_outlasting_the_idle_timeout_is_fine_while_it_keeps_talking():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 1.5 s in all, never silent for more than a quarter of the idle timeout
            await asyncio.sleep(0.25)
            await ex.answer(b"1\r\nx\r\n")
        await ex.answer(b"0\r\n\r\n")

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, Timeouts(connect=5, idle=1.0))
        assert await resp.read() == b"x" * 6
        resp.release()
        client.close()


async def test_total_timeout_bounds_a_trickling_answer():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # never silent for long, never finished
            await ex.answer(b"1\r\nx\r\n")
            await asyncio.sleep(0.01)

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server, Timeouts(connect=5, total=0.2))
        with pytest.raises(TimeoutError):
            await resp.read()
        resp.close()
        client.close()


async def test_first_bounds_the_exchange_until_end_first():
    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        if orjson.loads(ex.body)["first_chunk"]:
            await ex.answer(b"2\r\nhi\r\n")
        while True:  # never silent for long, never finished
            await asyncio.sleep(0.02)
            await ex.answer(b"1\r\nx\r\n")

    async with Server(handler) as server:
        client = H1Client()
        # Never ended: the stream is cut at ``first``, although it keeps talking.
        resp = await post(client, server, Timeouts(connect=5, idle=1.0, first=0.2), b'{"first_chunk": false}')
        with pytest.raises(FirstTimeout):
            await resp.read()
        resp.close()
        # Ended after the first chunk: only the idle timeout is left, the stream outlives ``first``.
        resp = await post(client, server, Timeouts(connect=5, idle=1.0, first=0.2), b'{"first_chunk": true}')
        assert await resp.read_some() == b"hi"
        resp.end_first()
        got = b""
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.5
        while loop.time() < until:
            got += await resp.read_some()
        assert got.startswith(b"x")
        resp.close()
        client.close()


async def test_first_bounds_waiting_for_the_head_and_idle_silence_is_a_plain_timeout():
    async def handler(ex: Exchange) -> None:
        await ex.reader.read()

    async with Server(handler) as server:
        client = H1Client()
        with pytest.raises(FirstTimeout):
            await post(client, server, Timeouts(connect=5, first=0.05))
        with pytest.raises(TimeoutError) as info:
            await post(client, server, Timeouts(connect=5, idle=0.05, first=5))
        assert not isinstance(info.value, FirstTimeout)
        client.close()


async def test_no_answer_at_all_times_out():
    async def handler(ex: Exchange) -> None:
        await ex.reader.read()

    async with Server(handler) as server:
        client = H1Client()
        with pytest.raises(TimeoutError):
            await post(client, server, Timeouts(connect=5, idle=0.05))
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
        client.close()


async def test_engine_hanging_up_mid_answer_and_garbage():
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", b"SMTP ready\r\n\r\n"]

    async def handler(ex: Exchange) -> None:
        await ex.answer(answers.pop(0))
        ex.writer.close()

    async with Server(handler) as server:
        client = H1Client()
        resp = await post(client, server)
        with pytest.raises(ServerDisconnected):
            await resp.read()
        resp.close()
        with pytest.raises(ProtocolError):
            await post(client, server)
        client.close()


async def test_unasked_bytes_on_an_idle_connection_retire_it():
    async def handler(ex: Exchange) -> None:
        await ex.answer(ok() + b"HTTP/1.1 200 OK\r\n")  # one answer too many

    async with Server(handler) as server:
        client = H1Client()
        for _ in range(2):
            resp = await post(client, server)
            await resp.read()
            resp.release()
            await asyncio.sleep(0.05)
        assert server.connections == 2
        client.close()


# ---- Upstream on top of the client

def upstream(**timeouts: float) -> Upstream:
    return Upstream(None, TimeoutsConfig(**timeouts))


async def test_refused_connection_marks_the_endpoint_down():
    ep = Endpoint(f"http://127.0.0.1:{free_port()}", "decode", healthy=True)
    up = upstream()
    with pytest.raises(EngineError) as info:
        await up.post(ep, "/v1/completions", {"a": 1}, "r", leg="decode")
    assert info.value.status == 502 and info.value.code == "engine_unreachable"
    assert not ep.healthy and ep.last_error.startswith("connect failed")
    up.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_oversized_json_answers_are_refused(chunked):
    big = b'{"x": "' + b"y" * MAX_JSON_BYTES + b'"}'

    async def handler(ex: Exchange) -> None:
        if chunked:
            await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                            % (len(big), big))
        else:
            await ex.answer(ok(big))

    async with Server(handler) as server:
        up = upstream()
        resp = await up.post(Endpoint(server.url, "prefill"), "/v1/completions", {}, "r", leg="prefill")
        with pytest.raises(EngineError, match="oversized"):
            await up.read_json(resp, "prefill")
        resp.close()
        up.close()


async def test_upstream_maps_timeouts_and_disconnects():
    async def handler(ex: Exchange) -> None:
        if orjson.loads(ex.body)["hang_up"]:
            ex.writer.close()
        else:
            await ex.reader.read()

    async with Server(handler) as server:
        up = upstream(prefill_s=0.1)
        ep = Endpoint(server.url, "prefill", healthy=True)
        with pytest.raises(EngineError) as info:
            await up.post(ep, "/v1/completions", {"hang_up": False}, "r", leg="prefill")
        assert info.value.status == 504 and info.value.code == "engine_timeout"
        with pytest.raises(EngineError) as info:
            await up.post(ep, "/v1/completions", {"hang_up": True}, "r", leg="prefill")
        assert info.value.status == 502 and "ServerDisconnected" in info.value.message
        assert ep.healthy  # the engine answered the connect: not down
        up.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_first_byte_timeout_is_a_504_from_an_engine_that_got_the_request(stream):
    """timeouts.decode_first_byte_s bounds the decode leg up to its first token (the whole answer
    when not streaming): a 504 engine_timeout the failover may retry, the connection dropped."""
    from gateway import legs
    from gateway.pools import Pools

    async def handler(ex: Exchange) -> None:
        if stream:  # the head at once, the first chunk never
            await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await ex.reader.read()

    async with Server(handler) as server:
        cfg = TimeoutsConfig(decode_first_byte_s=0.1, decode_idle_s=5)
        ep = Pools([], [server.url]).decode[0]
        started = asyncio.get_running_loop().time()
        with pytest.raises(legs.LegFailed) as info:
            await legs.open_decode(Upstream(None, cfg), ep, "/v1/completions", {"model": "m", "prompt": "x"}, "r",
                                   stream, {})
        assert 0.09 <= asyncio.get_running_loop().time() - started < 2  # uvloop: millisecond clock
        err = info.value.err
        assert (err.status, err.code) == (504, "engine_timeout")
        assert err.message == "The decode engine did not answer in time."
        assert info.value.reached
        await asyncio.wait_for(server.closed_by_client.wait(), 10)  # dropped: the engine aborts


async def test_decode_stream_outlives_decode_first_byte_once_its_first_token_is_in():
    from gateway import legs
    from gateway.pools import Pools

    async def handler(ex: Exchange) -> None:
        await ex.answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n")
        await asyncio.sleep(0.3)  # past decode_first_byte_s, within decode_idle_s
        await ex.answer(b"1\r\nx\r\n0\r\n\r\n")

    async with Server(handler) as server:
        cfg = TimeoutsConfig(decode_first_byte_s=0.1, decode_idle_s=5)
        ep = Pools([], [server.url]).decode[0]
        up = await legs.open_decode(Upstream(None, cfg), ep, "/v1/completions",
                                    {"model": "m", "prompt": "x", "stream": True}, "r", True, {})
        assert up.head == b"data:"
        assert await up.resp.read() == b"x"
        up.close(reuse=True)
