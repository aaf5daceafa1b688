"""The shared L2 in Redis (``--l2-url redis://127.0.0.1:6379/N``): a sorted set of block hashes by
last use, bounded to ``l2_blocks`` members (least recently used evicted first).

Keys (under ``--l2-key-prefix P``): ``P:lru`` (member: the raw block digest; score: a use stamp, larger
is more recent) and ``P:clock`` (the stamp counter). A write or a use is one Lua script, so
engines sharing the store never race: it stamps the keys with the first one most recent (a
prefix's head outlives its tail, as vLLM's LRU ranks a request's keys) and trims the set to its
capacity. A lookup is one ``ZMSCORE``.

Only hashes are stored: the simulator moves no KV, it charges the time the bytes would take
(:meth:`engine_model.config.SimConfig.l2_load_time`). Like LMCache's remote backends, the store is
written when blocks are offloaded and read on a miss.

Never blocking the engine: every call is asyncio (redis-py's asyncio client) and bounded by
``l2_timeout``. A store that cannot be reached answers as an empty one (lookups miss, writes are
dropped): the engine serves without L2, says so once in its log, and leaves the store alone for
``RETRY_AFTER`` seconds before it tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from policies.beliefs.blockhash import Digest

log = logging.getLogger("engine_model.tiers")

T = TypeVar("T")

RETRY_AFTER = 5.0

# KEYS: the set, the clock. ARGV: capacity (0: touch only, no trim), mode ("" or "XX"), keys...
_STAMP = """
local n = #ARGV - 2
local top = redis.call('INCRBY', KEYS[2], n)
for i = 1, n do
  if ARGV[2] == 'XX' then
    redis.call('ZADD', KEYS[1], 'XX', top - i + 1, ARGV[i + 2])
  else
    redis.call('ZADD', KEYS[1], top - i + 1, ARGV[i + 2])
  end
end
local cap = tonumber(ARGV[1])
if cap > 0 then
  local over = redis.call('ZCARD', KEYS[1]) - cap
  if over > 0 then
    redis.call('ZPOPMIN', KEYS[1], over)
    return over
  end
end
return 0
"""


class RedisL2:
    """:class:`engine_model.tiers.L2Store` over Redis (redis-py asyncio)."""

    def __init__(self, url: str, prefix: str, capacity: int, timeout: float = 0.5) -> None:
        self.url = url
        self.prefix = prefix
        self.capacity = capacity
        self.timeout = timeout
        self.zkey = f"{prefix}:lru"
        self.ckey = f"{prefix}:clock"
        self.errors = 0
        self.reachable: bool | None = None  # None: not tried yet
        self._client: Any = None
        self._script: Any = None
        self._down_until = 0.0
        self._warned = False

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            make: Any = aioredis.from_url
            self._client = make(self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout)
            self._script = self._client.register_script(_STAMP)
        return self._client

    async def _call(self, what: str, fn: Callable[[Any], Awaitable[T]], default: T) -> T:
        from redis.exceptions import RedisError

        loop = asyncio.get_running_loop()
        if loop.time() < self._down_until:
            return default
        try:
            result = await asyncio.wait_for(fn(self._redis()), self.timeout)
        except (RedisError, OSError, TimeoutError) as e:
            self.errors += 1
            self.reachable = False
            self._down_until = loop.time() + RETRY_AFTER
            if not self._warned:
                self._warned = True
                log.warning("L2 store %s failed on %s (%s): serving without L2 until it answers", self.url, what, e)
            return default
        if self.reachable is False:
            log.info("L2 store %s answers again", self.url)
        self.reachable = True
        return result

    async def probe(self, keys: Sequence[Digest]) -> list[bool]:
        if not keys:
            return []

        async def go(r: Any) -> list[bool]:
            scores = await r.zmscore(self.zkey, list(keys))
            return [s is not None for s in scores]

        return await self._call("lookup", go, [False] * len(keys))

    async def put(self, keys: Sequence[Digest]) -> bool:
        if not keys:
            return True

        async def go(r: Any) -> bool:
            await self._script(keys=[self.zkey, self.ckey], args=[self.capacity, "", *keys])
            return True

        return await self._call("store", go, False)

    async def touch(self, keys: Sequence[Digest]) -> None:
        if not keys:
            return

        async def go(r: Any) -> None:
            await self._script(keys=[self.zkey, self.ckey], args=[0, "XX", *keys])

        await self._call("touch", go, None)

    async def size(self) -> int | None:
        async def go(r: Any) -> int | None:
            return int(await r.zcard(self.zkey))

        return await self._call("size", go, None)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), self.timeout)
            except Exception as e:  # closing a dead connection: nothing left to do
                log.debug("closing the L2 client: %s", e)

    def describe(self) -> dict[str, Any]:
        return {
            "store": "redis",
            "url": self.url,
            "key_prefix": self.prefix,
            "capacity": self.capacity,
            "reachable": self.reachable,
            "errors": self.errors,
        }
