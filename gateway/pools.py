"""Engine endpoints, their live state, and the health checker that keeps it current."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from policies.base import EndpointView, PoolSnapshot

from .config import HealthConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    url: str
    pool: str
    healthy: bool = False  # unknown until the first probe answers
    in_flight: int = 0
    last_error: str = ""
    failed_probes: int = 0

    def view(self) -> EndpointView:
        return EndpointView(self.url, self.pool, self.healthy, self.in_flight)

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

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
    """Probes every endpoint's health path on an interval; an endpoint that keeps failing is
    skipped by routing until a probe succeeds again."""

    def __init__(self, pools: Pools, session: aiohttp.ClientSession, cfg: HealthConfig) -> None:
        self._pools = pools
        self._session = session
        self._cfg = cfg
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self._task: asyncio.Task | None = None

    async def probe(self, ep: Endpoint) -> None:
        try:
            async with self._session.get(ep.url + self._cfg.path, timeout=self._timeout) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            ok, why = False, f"health check failed: {type(err).__name__}"
        if ok:
            ep.failed_probes = 0
            ep.mark_up()
            return
        ep.failed_probes += 1
        # A busy engine can miss one probe; only a run of failures (or a refused request) takes it out.
        if ep.failed_probes >= self._cfg.failures_to_mark_down or not ep.healthy:
            ep.mark_down(why)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(ep) for ep in self._pools.all()))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.interval_s)
            try:
                await self.probe_all()
            except Exception:  # one bad round must not stop health checking for good
                log.exception("health check round failed")

    async def start(self) -> None:
        await self.probe_all()  # so /ready is truthful from the first request
        self._task = asyncio.create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
