"""Engine endpoints, their live state, and the health checker that keeps it current."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from policies.base import EndpointView, PoolSnapshot

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    url: str
    pool: str
    healthy: bool = False  # unknown until the first probe answers
    in_flight: int = 0
    last_error: str = ""

    def view(self) -> EndpointView:
        return EndpointView(self.url, self.pool, self.healthy, self.in_flight)

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("endpoint %s (%s) marked unhealthy: %s", self.url, self.pool, why)
        self.healthy = False
        self.last_error = why

    def mark_up(self) -> None:
        if not self.healthy:
            log.info("endpoint %s (%s) is healthy", self.url, self.pool)
        self.healthy = True
        self.last_error = ""


class Pools:
    """The prefill and decode pools; the only owner of endpoint state."""

    def __init__(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        self.prefill = [Endpoint(u, "prefill") for u in prefill]
        self.decode = [Endpoint(u, "decode") for u in decode]
        self._by_url = {(e.pool, e.url): e for e in self.all()}

    def all(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    def get(self, view: EndpointView) -> Endpoint:
        return self._by_url[(view.pool, view.url)]

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(e.view() for e in self.prefill), tuple(e.view() for e in self.decode))

    def ready(self) -> bool:
        return any(e.healthy for e in self.decode)


class HealthChecker:
    """Probes every endpoint's health path on an interval; an endpoint that fails is skipped
    by routing until a probe succeeds again."""

    def __init__(
        self, pools: Pools, session: aiohttp.ClientSession, path: str, interval_s: float, timeout_s: float
    ) -> None:
        self._pools = pools
        self._session = session
        self._path = path
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task | None = None

    async def probe(self, ep: Endpoint) -> None:
        try:
            async with self._session.get(ep.url + self._path, timeout=self._timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    ep.mark_up()
                else:
                    ep.mark_down(f"health check answered {resp.status}")
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            ep.mark_down(f"health check failed: {type(err).__name__}")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(ep) for ep in self._pools.all()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.probe_all()

    async def start(self) -> None:
        await self.probe_all()  # so /ready is truthful from the first request
        self._task = asyncio.create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
