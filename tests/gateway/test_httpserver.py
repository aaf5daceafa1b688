"""The server transport shim that sends a response's head with its body."""

from __future__ import annotations

import asyncio

from gateway.httpserver import HeadHoldingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 7


def shim() -> tuple[HeadHoldingTransport, FakeTransport]:
    raw = FakeTransport()
    return HeadHoldingTransport(raw, asyncio.get_running_loop()), raw  # type: ignore[arg-type]


async def test_head_and_body_go_out_in_one_write():
    t, raw = shim()
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert raw.writes == []
    t.write(b"hi")
    assert raw.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"]
    await asyncio.sleep(0)
    assert len(raw.writes) == 1


async def test_a_head_without_body_yet_goes_out_at_the_next_loop_turn():
    t, raw = shim()
    t.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    await asyncio.sleep(0)
    assert raw.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    t.write(b"5\r\nfirst\r\n")
    t.write(b"0\r\n\r\n")
    assert raw.writes[1:] == [b"5\r\nfirst\r\n", b"0\r\n\r\n"]


async def test_close_sends_what_is_held_first():
    t, raw = shim()
    t.write(b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\n\r\n")
    t.close()
    assert raw.writes == [b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\n\r\n"] and raw.closed
    await asyncio.sleep(0)
    assert len(raw.writes) == 1


async def test_everything_else_is_the_transport_s():
    t, _ = shim()
    assert t.get_write_buffer_size() == 7
    assert not t.is_closing()
