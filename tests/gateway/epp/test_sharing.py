"""Access log entries passed between pickers over a real Redis (gateway/epp/sharing.py): an entry
that reaches the picker that does not hold its request ends the request on the one that does."""

from __future__ import annotations

import asyncio
import socket
import uuid

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.config import StateConfig
from gateway.epp.completions import Completions
from gateway.epp.proto import envoy_subset_pb2 as pb
from gateway.epp.sharing import SharedEndings


def _redis_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return True
    except OSError:
        return False


class Held:
    def __init__(self) -> None:
        self.held = True
        self.ended: tuple | None = None

    def served(self, *ending) -> None:
        self.ended = ending

    def unconfirmed(self) -> None:
        self.ended = ("unconfirmed",)


def entry(request_id: str) -> pb.HTTPAccessLogEntry:
    e = pb.HTTPAccessLogEntry()
    e.request.request_headers["x-request-id"] = request_id
    e.response.response_code.value = 200
    e.common_properties.upstream_remote_address.socket_address.address = "10.0.0.2"
    e.common_properties.upstream_remote_address.socket_address.port_value = 8000
    return e


async def test_an_entry_sent_to_the_other_picker_ends_the_request_where_it_is_held() -> None:
    if not await asyncio.to_thread(_redis_answers):
        pytest.skip("no Redis answers on 127.0.0.1:6379 (start redis-server; .ci/run does)")
    cfg = StateConfig(backend="redis", url="redis://127.0.0.1:6379/0", key_prefix=f"pdgate-test-{uuid.uuid4().hex}")
    a_done, b_done = Completions(60), Completions(60)
    a, b = SharedEndings(cfg, a_done), SharedEndings(cfg, b_done)
    await a.start()
    await b.start()
    try:
        await asyncio.wait_for(asyncio.gather(a.subscribed.wait(), b.subscribed.wait()), 5)
        held, mine = Held(), Held()
        a_done.hold("r-a", held)
        b_done.hold("r-b", mine)
        b_done.report(entry("r-a"))  # Envoy's log went to picker B; picker A routed the request
        b_done.report(entry("r-b"))  # B's own: ended at once, nothing published
        for _ in range(100):
            if held.ended is not None:
                break
            await asyncio.sleep(0.05)
        assert held.ended == (200, "10.0.0.2:8000", None, None)
        assert mine.ended == (200, "10.0.0.2:8000", None, None)
        assert (b.published, a.applied, len(a_done), len(b_done)) == (1, 1, 0, 0)
        assert b.received == 0  # its own message is not applied back
        b_done.report(entry("nobody"))  # held by no picker: published, applied nowhere
        await asyncio.sleep(0.3)
        assert a.received == 2 and a.applied == 1
    finally:
        await asyncio.wait_for(asyncio.gather(a.stop(bound_s=2), b.stop(bound_s=2)), 5)
    assert a_done.forward is None  # stopped: nothing is published any more


async def test_a_malformed_ending_is_skipped_and_the_next_one_still_applied() -> None:
    if not await asyncio.to_thread(_redis_answers):
        pytest.skip("no Redis answers on 127.0.0.1:6379 (start redis-server; .ci/run does)")
    cfg = StateConfig(backend="redis", url="redis://127.0.0.1:6379/0", key_prefix=f"pdgate-test-{uuid.uuid4().hex}")
    done = Completions(60)
    a = SharedEndings(cfg, done)
    other = aioredis.Redis.from_url(cfg.url)  # another picker (another version of it) on the channel
    await a.start()
    try:
        await asyncio.wait_for(a.subscribed.wait(), 5)
        held = Held()
        done.hold("r-held", held)
        await other.publish(a.channel, orjson.dumps(["other", "r-x", "abc", "10.0.0.2:8000", 0.1, 0.2]))
        await other.publish(a.channel, orjson.dumps(["other", "r-held", 200, "10.0.0.2:8000", 0.1, 0.2]))
        for _ in range(100):
            if held.ended is not None:
                break
            await asyncio.sleep(0.05)
        assert held.ended == (200, "10.0.0.2:8000", 0.1, 0.2)
        assert a.applied == 1 and all(not t.done() for t in a._tasks)
    finally:
        await asyncio.wait_for(a.stop(bound_s=2), 5)
        await other.aclose()
