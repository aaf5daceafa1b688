"""The guard's stall bound on connections that close (gateway/http/server.py): the sequences a
real socket makes hard to time, driven on the protocol with a transport whose buffer the test
sets (tests/gateway/test_server.py covers the bound end to end on real sockets)."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from gateway.http.connections import Connections, Limits
from gateway.http.server import guarded_protocol

STALL_S = 0.2


class Transport:
    """What the guard and uvicorn's protocol use of a transport; ``buffered`` is set by the test."""

    def __init__(self) -> None:
        self.buffered = 0
        self.closing = False
        self.aborted = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def write(self, data: bytes) -> None:
        self.buffered += len(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _connection(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Protocol, Transport, Connections]:
    async def app(scope, receive, send) -> None:  # never reached: no request is sent
        raise AssertionError

    config = uvicorn.Config(app, lifespan="off", log_level="warning", ws="none")
    config.load()
    connections = Connections(10)
    protocol = guarded_protocol(Limits(stall_timeout_s=STALL_S), connections)(
        config=config, server_state=ServerState(), app_state={}, _loop=loop
    )
    transport = Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport, connections


async def test_a_cut_connection_keeps_its_stall_deadline_when_its_buffer_drains_a_little():
    """Paused, then cut by the guard (bytes that are not HTTP): the client reads a little (the
    buffer falls below low water, ``resume_writing``) and stops. The close waits for that
    buffer: the deadline stays, and the connection is reset."""
    protocol, transport, connections = _connection(asyncio.get_running_loop())
    transport.buffered = 100_000
    protocol.pause_writing()
    protocol.data_received(b"\x00 not http\r\n\r\n")  # the guard cuts the connection
    transport.buffered = 10_000
    protocol.resume_writing()
    await asyncio.sleep(STALL_S * 3)
    assert transport.aborted and connections.stalled == 1
    protocol.connection_lost(None)


async def test_a_client_that_half_closes_and_reads_nothing_is_reset():
    """The client's FIN closes the transport once its buffer is read, behind the guard's
    back; with bytes waiting and never read, only the stall bound ends it."""
    protocol, transport, connections = _connection(asyncio.get_running_loop())
    transport.buffered = 10_000  # under the high-water mark: no pause_writing
    protocol.eof_received()
    transport.closing = True  # (what asyncio does when eof_received returns None)
    await asyncio.sleep(STALL_S * 3)
    assert transport.aborted and connections.stalled == 1
    protocol.connection_lost(None)


async def test_an_open_connection_whose_client_resumes_reading_keeps_no_deadline():
    protocol, transport, connections = _connection(asyncio.get_running_loop())
    transport.buffered = 100_000
    protocol.pause_writing()
    transport.buffered = 0
    protocol.resume_writing()
    await asyncio.sleep(STALL_S * 3)
    assert not transport.aborted and connections.stalled == 0
    protocol.connection_lost(None)


async def test_nothing_is_armed_after_the_connection_is_lost():
    protocol, transport, connections = _connection(asyncio.get_running_loop())
    transport.buffered = 100_000
    protocol.connection_lost(None)
    protocol.pause_writing()
    await asyncio.sleep(STALL_S * 3)
    assert not transport.aborted and connections.stalled == 0
