"""Shared routing state over a real Redis (gateway/cluster/redis_state.py): what other replicas (or
another version of the gateway, or a person) wrote and this replica cannot read is skipped, and
everything else still applies; a lookup still answers, a sync still completes, startup still works."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.cluster.redis_state import RedisState, _key
from gateway.config import StateConfig
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
D1, D2, D3 = "http://d-1:8000", "http://d-2:8000", "http://d-3:8000"


def _redis_answers() -> bool:
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
async def shared() -> AsyncIterator[tuple[StateConfig, aioredis.Redis]]:
    """A key prefix of its own on the local Redis, and a plain client to write what others would."""
    if not await asyncio.to_thread(_redis_answers):
        pytest.skip(f"no Redis answers on {REDIS_HOST}:{REDIS_PORT} (start redis-server; .ci/run does)")
    prefix = f"pdgate-test-state-{uuid.uuid4().hex[:8]}"
    cfg = StateConfig(backend="redis", url=f"redis://{REDIS_HOST}:{REDIS_PORT}/0", key_prefix=prefix, timeout_s=2.0)
    raw = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=2)
    try:
        yield cfg, raw
    finally:
        keys = [k async for k in raw.scan_iter(f"{prefix}:*")]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()


@pytest.mark.parametrize("bad", [b"not-a-time", b"\xff\xfe"], ids=["not-a-number", "not-utf8"])
async def test_a_lookup_skips_a_block_entry_it_cannot_read_and_routes_on_the_rest(
    shared: tuple[StateConfig, aioredis.Redis], bad: bytes
) -> None:
    cfg, raw = shared
    now = str(time.time())
    await raw.hset(f"{cfg.key_prefix}:blk:{_key(1)}", mapping={D1: now, D2: bad, D3: now})
    await raw.hset(f"{cfg.key_prefix}:blk:{_key(2)}", mapping={D1: now, D3: bad})
    state = RedisState(cfg, 60.0, Pools([], [D1, D2, D3]))
    try:
        # what every request whose prompt starts with these blocks gets (it used to fail with a 500)
        assert await state.match([1, 2]) == {D1: 2, D3: 1}
        assert state.status.healthy and state.usable  # a bad entry is not Redis being down
    finally:
        await state.stop()


@pytest.mark.parametrize("spoiled", ["resets", "inflight", "tenants"])
async def test_a_sync_skips_entries_it_cannot_read_and_applies_the_rest(
    shared: tuple[StateConfig, aioredis.Redis], spoiled: str
) -> None:
    cfg, raw = shared
    p, other, now = cfg.key_prefix, uuid.uuid4().hex[:12], time.time()
    await raw.zadd(f"{p}:replicas", {other: now})
    # D1 restarted half a second ago: what it learned before no longer counts
    await raw.hset(f"{p}:resets", mapping={D1: str(now - 0.5)})
    await raw.hset(f"{p}:blk:{_key(1)}", mapping={D1: str(now - 1), D2: str(now - 1)})
    await raw.hset(f"{p}:inflight:{other}", mapping={D2: "3"})
    await raw.hset(f"{p}:tenants:{other}", mapping={"p|acme": "2.5"})
    bad = {
        "resets": (f"{p}:resets", {D2: "x", D3: b"\xff"}),
        "inflight": (f"{p}:inflight:{other}", {D1: "1.5", D3: "lots"}),
        "tenants": (f"{p}:tenants:{other}", {"p|other-co": "lots", "d|acme": b"\xff"}),
    }
    key, fields = bad[spoiled]
    await raw.hset(key, mapping=fields)
    pools, usage = Pools([], [D1, D2, D3]), Usage()
    pools.others = {D1: 99}  # a previous round's counts: replaced, not kept
    state = RedisState(cfg, 60.0, pools, usage=usage)
    try:
        await state.start()  # a bad entry does not fail startup
        assert state.status.healthy
        assert pools.others == {D2: 3}
        assert usage.others["prefill"] == {"acme": 2.5} and usage.others["decode"] == {}
        assert await state.match([1]) == {D2: 1}  # D1's reset applied, D2's unreadable one skipped
    finally:
        await state.stop()
