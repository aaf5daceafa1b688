"""The decode leg's start (gateway/engines/legs.py): reading a stream up to its first token, to
tell a leg that failed before it (retried elsewhere) from one that began answering."""

from __future__ import annotations

import pytest

from gateway.engines.legs import LegFailed, _read_head

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}'
ERROR = b'data: {"error":{"message":"KV load failed","code":500}}'


class Reads:
    """An engine response whose body comes in the given reads."""

    def __init__(self, *reads: bytes) -> None:
        self._reads = list(reads)

    async def read_some(self) -> bytes:
        return self._reads.pop(0) if self._reads else b""


def framed(events: list[bytes], eol: bytes = b"\n", keepalive: bool = False) -> bytes:
    ka = b": keep-alive" + eol + eol if keepalive else b""
    return b"".join(ka + e + eol + eol for e in events)


@pytest.mark.parametrize(("eol", "keepalive"), [(b"\n", False), (b"\r\n", False), (b"\n", True), (b"\r\n", True)])
async def test_the_head_reads_past_the_role_chunk_to_the_first_token_in_any_framing(eol, keepalive):
    role, token = framed([ROLE], eol, keepalive), framed([TOKEN], eol, keepalive)
    head = await _read_head(Reads(role, token), stream=True, max_head_bytes=4096)  # type: ignore[arg-type]
    assert head == role + token


@pytest.mark.parametrize(("eol", "keepalive"), [(b"\n", False), (b"\r\n", False), (b"\n", True), (b"\r\n", True)])
async def test_an_error_as_the_first_event_after_the_role_chunk_fails_the_leg_before_its_first_token(eol, keepalive):
    with pytest.raises(LegFailed) as failed:
        await _read_head(Reads(framed([ROLE], eol, keepalive), framed([ERROR], eol, keepalive)), True, 4096)  # type: ignore[arg-type]
    assert failed.value.err.status == 502 and "before its first token" in failed.value.err.message


async def test_a_head_of_role_chunks_and_comments_only_is_bounded():
    with pytest.raises(LegFailed) as failed:
        await _read_head(Reads(*[framed([ROLE], keepalive=True)] * 50), True, 1000)  # type: ignore[arg-type]
    assert "oversized" in failed.value.err.message
