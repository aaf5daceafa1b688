"""Routing state shared by several gateway replicas through Redis.

What is shared, and how:

- **learned prefix blocks** (the gateway's own routing history): one Redis hash per block,
  ``{prefix}:blk:<hash>`` -> ``{endpoint url: unix time learned}``, expiring ``learned_ttl_s``
  after its last write. A replica looks a prompt's blocks up in one pipelined round trip and
  merges the answer with its local index, so affinity holds whichever replica a request lands on.
  Blocks known from the engines' KV events are not copied to Redis: every replica subscribes to
  the engines' feeds itself (ZMQ PUB serves any number of subscribers) and holds the same view.
- **forgotten engines**: an engine that restarted (or whose answers showed blocks gone) has its
  entries learned up to some time voided: ``{prefix}:resets`` -> ``{endpoint url: unix time}``,
  applied by every replica's lookups (read back on each sync).
- **tenant use** (fair queueing, gateway/fairness/tenants.py): published and read with the in-flight counts,
  ``{prefix}:tenants:<replica id>`` -> ``{phase|tenant: use}``, summed over the other replicas.
- **in-flight requests per endpoint**: each replica publishes its own counts every
  ``sync_interval_s`` in ``{prefix}:inflight:<replica id>`` (expiring after a few intervals, so a
  dead replica's counts vanish) and reads the others'. A replica's routing sees its own counts
  live and the others' at most one interval old.

Redis is never on the critical path for longer than ``timeout_s``: a lookup that errs or times
out marks the backend down, routing carries on with local state, and Redis is retried after
``retry_s``. Writes go through a bounded queue drained in the background (dropped, and counted,
when Redis cannot keep up). Memory in Redis is bounded by the TTLs: roughly 100 bytes per
(block, endpoint) learned within ``learned_ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.background import STOP_BOUND_S, cancel_checkpoint, stop_task, stop_tasks
from gateway.config import StateConfig
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage
from policies.beliefs.blockhash import BlockHash

log = logging.getLogger(__name__)

MAX_LOOKUP_BLOCKS = 4096  # a 64k-token prompt at block size 16; longer prompts match on their start
_WRITE_QUEUE = 1024  # pending learn() batches
_CLEANUP_S = 1.0  # longest the last steps with Redis (remove this replica's keys, close) may take


def _key(h: BlockHash) -> str:
    return h.hex() if isinstance(h, bytes) else format(h, "x")


def _numbers(row: dict[str, str]) -> Iterator[tuple[str, float]]:
    """A hash's fields whose values read as finite numbers. Other replicas (another version of the
    gateway), or a person, write these hashes too: a value this one cannot read is skipped, so it
    neither fails a lookup or a sync nor leaves one half applied."""
    for name, value in row.items():
        try:
            x = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):  # inf or nan would void an endpoint, or poison a sum, for good
            yield name, x


def leading_runs(
    rows: Iterable[dict[str, str]], oldest: float, resets: dict[str, float] | None = None
) -> dict[str, int]:
    """Per endpoint, how many of the first blocks in a row it holds (learned at or after ``oldest``,
    and after the endpoint's time in ``resets``)."""
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    resets = resets or {}
    n = 0
    for row in rows:
        holders = {url for url, ts in _numbers(row) if ts >= oldest and ts > resets.get(url, 0.0)}
        if alive is None:
            alive = holders
        else:
            for url in alive - holders:
                counts[url] = n
            alive &= holders
        if not alive:
            break
        n += 1
    for url in alive or ():
        counts[url] = n
    return counts


@dataclass
class StateStatus:
    backend: str
    healthy: bool
    last_error: str = ""
    since: float = field(default_factory=time.time)


class RedisState:
    def __init__(
        self,
        cfg: StateConfig,
        learned_ttl_s: float,
        pools: Pools,
        client: aioredis.Redis | None = None,
        usage: Usage | None = None,
    ) -> None:
        self.cfg = cfg
        self.learned_ttl_s = learned_ttl_s
        self.replica = uuid.uuid4().hex[:12]
        self._pools = pools  # its ``others`` get the other replicas' in-flight counts
        self._usage = usage  # its ``others`` get the other replicas' tenant use
        # Redis.from_url: what redis.asyncio.from_url calls, and annotated (that wrapper is not)
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            cfg.redis_url(),
            socket_timeout=cfg.timeout_s,
            socket_connect_timeout=cfg.timeout_s,
            health_check_interval=0,
            decode_responses=True,
            # bytes that are not UTF-8 (written by anyone) read as U+FFFD, a value _numbers skips,
            # instead of a UnicodeDecodeError failing the whole lookup (and the request with it)
            encoding_errors="replace",
        )
        self._p = cfg.key_prefix
        self.status = StateStatus("redis", healthy=False, last_error="not connected yet")
        self._down_until = 0.0
        self._writes: asyncio.Queue[tuple[str, Sequence[BlockHash]]] = asyncio.Queue(_WRITE_QUEUE)
        self._resets: dict[str, float] = {}  # url -> entries learned up to then are void (every replica's)
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped_writes = 0
        self.errors = 0

    # -- health --------------------------------------------------------------------------------

    def _failed(self, err: BaseException) -> None:
        self.errors += 1
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        if self.status.healthy:
            log.warning("shared state on Redis unavailable (%s); routing on local state", why)
            self.status = StateStatus("redis", healthy=False, last_error=why)
        self._down_until = time.monotonic() + self.cfg.retry_s
        self._pools.others = {}  # stale counts would steer traffic for nothing
        if self._usage is not None:  # fairness goes on with this replica's own view
            self._usage.others = {p: {} for p in Usage.PHASES}

    def _ok(self) -> None:
        if not self.status.healthy:
            log.info("shared state on Redis available")
            self.status = StateStatus("redis", healthy=True)

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    # -- prefix blocks -------------------------------------------------------------------------

    async def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading learned blocks per endpoint, from every replica's routing; {} when Redis is down."""
        if not hashes or not self.usable:
            return {}
        hashes = hashes[:MAX_LOOKUP_BLOCKS]
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                pipe = self._redis.pipeline(transaction=False)
                for h in hashes:
                    pipe.hgetall(f"{self._p}:blk:{_key(h)}")
                rows = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as err:
            self._failed(err)
            return {}
        self._ok()
        return leading_runs(rows, time.time() - self.learned_ttl_s, self._resets)

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        if not hashes or not self.usable:
            return
        try:
            self._writes.put_nowait((url, hashes[:MAX_LOOKUP_BLOCKS]))
        except asyncio.QueueFull:
            self.dropped_writes += 1

    def forget(self, url: str, until: float) -> None:
        """What ``url`` learned up to ``until`` (unix time) no longer counts, for every replica."""
        if until > self._resets.get(url, 0.0):
            self._resets[url] = until
        try:
            self._writes.put_nowait((url, ()))  # an empty batch writes the reset
        except asyncio.QueueFull:
            self.dropped_writes += 1

    async def _writer(self) -> None:
        ttl = max(1, int(self.learned_ttl_s))
        while True:
            url, hashes = await self._writes.get()
            now = str(time.time())
            try:
                pipe = self._redis.pipeline(transaction=False)
                if not hashes:
                    pipe.hset(f"{self._p}:resets", url, str(self._resets.get(url, 0.0)))
                    pipe.expire(f"{self._p}:resets", ttl)
                for h in hashes:
                    key = f"{self._p}:blk:{_key(h)}"
                    pipe.hset(key, url, now)
                    pipe.expire(key, ttl)
                async with asyncio.timeout(max(self.cfg.timeout_s, 1.0)):
                    await pipe.execute()
            except (RedisError, OSError, TimeoutError) as err:
                self._failed(err)
            cancel_checkpoint()  # redis-py can swallow a cancel (see gateway/background.py)

    # -- in-flight counts ----------------------------------------------------------------------

    async def sync_in_flight(self) -> None:
        """Publish this replica's counts, read the others'."""
        if not self.usable:
            return
        mine = f"{self._p}:inflight:{self.replica}"
        ttl_ms = int(self.cfg.sync_interval_s * 4000)
        counts: dict[str, int] = {}
        for ep in self._pools.all():
            counts[ep.url] = counts.get(ep.url, 0) + ep.in_flight
        mine_usage = f"{self._p}:tenants:{self.replica}"
        usage = self._usage_fields()
        try:
            async with asyncio.timeout(max(self.cfg.timeout_s, 0.5)):
                pipe = self._redis.pipeline(transaction=False)
                pipe.delete(mine)
                if counts:
                    pipe.hset(mine, mapping={u: str(n) for u, n in counts.items()})
                    pipe.pexpire(mine, ttl_ms)
                if self._usage is not None:
                    pipe.delete(mine_usage)
                    if usage:
                        pipe.hset(mine_usage, mapping=usage)
                        pipe.pexpire(mine_usage, ttl_ms)
                pipe.zadd(f"{self._p}:replicas", {self.replica: time.time()})
                pipe.zremrangebyscore(f"{self._p}:replicas", 0, time.time() - self.cfg.sync_interval_s * 4)
                pipe.zrange(f"{self._p}:replicas", 0, -1)
                pipe.hgetall(f"{self._p}:resets")
                *_, replicas, resets = await pipe.execute()
                others = [r for r in replicas if r != self.replica]
                pipe = self._redis.pipeline(transaction=False)
                for r in others:
                    pipe.hgetall(f"{self._p}:inflight:{r}")
                    if self._usage is not None:
                        pipe.hgetall(f"{self._p}:tenants:{r}")
                rows = await pipe.execute() if others else []
        except (RedisError, OSError, TimeoutError) as err:
            self._failed(err)
            return
        self._ok()
        for url, until in _numbers(resets):
            if until > self._resets.get(url, 0.0):
                self._resets[url] = until
        step = 2 if self._usage is not None else 1
        total: dict[str, int] = {}
        for row in rows[::step]:
            for url, n in _numbers(row):
                if n.is_integer():  # a count; anything else is not one this replica can use
                    total[url] = total.get(url, 0) + int(n)
        self._pools.others = total
        if self._usage is not None:
            self._usage.others = _others_usage(rows[1::2])

    def _usage_fields(self) -> dict[str, str]:
        """This replica's tenant use as hash fields: ``<phase letter>|<tenant>`` -> value."""
        if self._usage is None:
            return {}
        return {
            f"{phase[0]}|{tenant}": str(round(v, 3))
            for phase, row in self._usage.snapshot().items()
            for tenant, v in row.items()
            if v
        }

    async def _syncer(self) -> None:
        while True:
            try:
                await self.sync_in_flight()
            except Exception:  # one bad round must not end sharing for good (not BaseException: stop must work)
                log.exception("shared state sync failed")
            cancel_checkpoint()  # redis-py can swallow a cancel mid round trip (see gateway/background.py)
            await asyncio.sleep(self.cfg.sync_interval_s)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.sync_in_flight()  # connect now, so /ready is truthful from the start
        self._tasks = [
            asyncio.create_task(self._writer(), name="state-writer"),
            asyncio.create_task(self._syncer(), name="state-sync"),
        ]

    async def stop(self, bound_s: float = STOP_BOUND_S) -> None:
        """Stop syncing, remove this replica's keys and close; at most ``bound_s`` in all, even when
        Redis is dead or a cancellation gets swallowed inside a round trip (shutdown waits on this)."""
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks, bound_s=max(bound_s - _CLEANUP_S, 0.1))
        # In a task of its own: redis-py retries with backoff (seconds) and can swallow the cancel
        # that asyncio.timeout relies on, so only stop_task's re-cancel bounds it for sure.
        cleanup = asyncio.create_task(self._cleanup(), name="state-cleanup")
        await stop_task(cleanup, grace_s=_CLEANUP_S * 0.8, bound_s=_CLEANUP_S)

    async def _cleanup(self) -> None:
        # Others would count this replica's in-flight requests until its keys expire: best effort.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(_CLEANUP_S / 2):
                pipe = self._redis.pipeline(transaction=False)
                pipe.delete(f"{self._p}:inflight:{self.replica}", f"{self._p}:tenants:{self.replica}")
                pipe.zrem(f"{self._p}:replicas", self.replica)
                await pipe.execute()
        await self._redis.aclose()


def _others_usage(rows: list[dict[str, str]]) -> dict[str, dict[str, float]]:
    """The other replicas' tenant use, summed per phase and tenant (``_usage_fields``'s reverse)."""
    phases = {p[0]: p for p in Usage.PHASES}  # first letters: p, d, g, o
    theirs: dict[str, dict[str, float]] = {p: {} for p in Usage.PHASES}
    for row in rows:
        for name, v in _numbers(row):
            phase, _, tenant = name.partition("|")
            if phase in phases:
                t = theirs[phases[phase]]
                t[tenant] = t.get(tenant, 0.0) + v
    return theirs
