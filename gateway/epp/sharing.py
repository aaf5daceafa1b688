"""Access log entries passed between pickers over Redis, so that several can serve one Envoy.

Envoy streams its access log to one picker (one gRPC stream per worker thread, to one host of the
picker cluster), while the ext_proc streams spread over all of them: the entry for a request that
another picker routed arrives where nothing holds it. Each picker publishes such an entry's ending
(request id, status, engine, first byte, duration) on ``<state.key_prefix>:epp:ended``; every
picker subscribes, and the one holding the request ends it. Publishing is fire and forget through
a bounded queue (dropped when full: the request is then released by ``epp.completion_timeout_s``);
a lost connection is retried every ``state.retry_s``; both tasks stop within the lifecycle's bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.background import STOP_BOUND_S, stop_tasks
from gateway.config import StateConfig
from gateway.epp.completions import Completions, Ending

log = logging.getLogger(__name__)

QUEUE = 10_000  # endings waiting to be published


class SharedEndings:
    """Publishes the endings this picker does not hold; ends the held ones others publish."""

    def __init__(self, cfg: StateConfig, completions: Completions, client: aioredis.Redis | None = None) -> None:
        self.cfg = cfg
        self.channel = f"{cfg.key_prefix}:epp:ended"
        self.completions = completions
        self.replica = uuid.uuid4().hex[:12]
        # its own connection: a subscriber blocks on reads, past the shared state's 50 ms timeout
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            cfg.redis_url(), socket_connect_timeout=1.0, health_check_interval=30
        )
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE)
        self._tasks: list[asyncio.Task[None]] = []
        self.published = self.received = self.applied = self.dropped = self.errors = 0
        self.subscribed = asyncio.Event()

    def forward(self, ending: tuple[str, *Ending]) -> None:
        """An entry for a request this picker does not hold (its id, then how it ended): for the one
        that does."""
        try:
            self._queue.put_nowait(orjson.dumps([self.replica, *ending]))
        except asyncio.QueueFull:
            self.dropped += 1

    async def start(self) -> None:
        self.completions.forward = self.forward
        self._tasks = [
            asyncio.create_task(self._publisher(), name="epp-endings-publish"),
            asyncio.create_task(self._subscriber(), name="epp-endings-subscribe"),
        ]

    async def stop(self, bound_s: float = STOP_BOUND_S) -> None:
        self.completions.forward = None
        tasks, self._tasks = self._tasks, []
        await stop_tasks(tasks, bound_s=bound_s / 2)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(bound_s / 2):
                await self._redis.aclose()

    async def _publisher(self) -> None:
        while True:
            message = await self._queue.get()
            try:
                await self._redis.publish(self.channel, message)
                self.published += 1
            except (RedisError, OSError) as err:
                self._failed("publish", err)
                await asyncio.sleep(self.cfg.retry_s)

    async def _subscriber(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._apply(message.get("data"))
            except (RedisError, OSError) as err:
                self.subscribed.clear()
                self._failed("subscribe", err)
                await asyncio.sleep(self.cfg.retry_s)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # (redis-py leaves it unannotated)

    def _apply(self, data: Any) -> None:
        try:
            origin, request_id, status, upstream, first, duration = orjson.loads(data)
            # read inside the try: raising in the subscriber would end it for good, and every later ending with it
            ending: Ending = (int(status), upstream, first, duration)
        except (orjson.JSONDecodeError, TypeError, ValueError):
            return  # not ours (another writer on the channel), or malformed (another version): skipped
        if origin == self.replica:
            return
        self.received += 1
        if self.completions.end(str(request_id), ending):
            self.applied += 1

    def _failed(self, what: str, err: BaseException) -> None:
        self.errors += 1
        log.warning("epp: access log endings over Redis: %s failed (%s: %s)", what, type(err).__name__, err)
