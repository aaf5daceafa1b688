"""Engine endpoints, their live state, and the health checker that keeps it current."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from policies.base import EndpointView, PoolSnapshot

from .config import HealthConfig, OutlierConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine last reported on /metrics."""

    running: int
    waiting: int
    kv_usage: float | None
    block_size: int | None
    at: float  # time.monotonic() of the scrape


# Learning the prefill speed: smoothing of the per-token estimate, and the smallest amount of
# prompt work whose timing says more about the engine than about HTTP overheads.
_SPEED_ALPHA = 0.2
_MIN_LEARN_TOKENS = 32


@dataclass(slots=True)
class PrefillTicket:
    tokens: int
    ahead: int  # prompt tokens the gateway had already queued on the endpoint
    started: float


@dataclass(eq=False)
class Endpoint:
    url: str
    pool: str
    healthy: bool = False  # unknown until the first probe answers
    in_flight: int = 0
    last_error: str = ""
    failed_probes: int = 0
    stats: EngineStats | None = None
    # Uncached prompt tokens sent to the engine whose prefill has not visibly finished.
    backlog_tokens: int = 0
    prefill_s_per_token: float | None = None
    on_release: Callable[[], None] | None = None  # the pools' "capacity freed" signal
    # Passive health (outlier ejection), fed by the outcome of real requests.
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    consecutive_failures: int = 0
    outcomes: deque[bool] = field(default_factory=deque)
    ejected_until: float = 0.0
    ejections: int = 0  # in a row: each one lasts twice as long as the one before

    @property
    def ejected(self) -> bool:
        return time.monotonic() < self.ejected_until

    def record(self, ok: bool) -> None:
        """The outcome of one request to this engine (engine errors, not client mistakes)."""
        cfg = self.outlier
        self.outcomes.append(ok)
        while len(self.outcomes) > cfg.window:
            self.outcomes.popleft()
        if ok:
            self.consecutive_failures = 0
            if not self.ejected and self.ejections and all(self.outcomes):
                self.ejections = 0  # a clean window after an ejection: forgiven
            return
        self.consecutive_failures += 1
        failed = self.outcomes.count(False)
        too_many = self.consecutive_failures >= cfg.consecutive_failures or (
            len(self.outcomes) >= cfg.min_requests and failed / len(self.outcomes) >= cfg.error_rate)
        if too_many and not self.ejected:
            seconds = min(cfg.base_ejection_s * 2 ** self.ejections, cfg.max_ejection_s)
            self.ejected_until = time.monotonic() + seconds
            self.ejections += 1
            self.consecutive_failures = 0
            self.outcomes.clear()
            log.warning("endpoint %s (%s) ejected for %.0f s after failed requests", self.url, self.pool, seconds)

    def view(self, now: float = 0.0, max_age_s: float = 0.0, others: int = 0) -> EndpointView:
        """``others``: requests other gateway replicas have in flight here (shared state)."""
        st = self.stats
        usable = self.healthy and not self.ejected
        if st is None or now - st.at > max_age_s:
            return EndpointView(self.url, self.pool, usable, self.in_flight + others,
                                backlog_tokens=self.backlog_tokens, prefill_s_per_token=self.prefill_s_per_token)
        return EndpointView(self.url, self.pool, usable, self.in_flight + others, st.running, st.waiting,
                            st.kv_usage, self.backlog_tokens, self.prefill_s_per_token)

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        if self.on_release is not None:
            self.on_release()

    def start_prefill(self, tokens: int) -> PrefillTicket:
        ticket = PrefillTicket(tokens, self.backlog_tokens, time.monotonic())
        self.backlog_tokens += tokens
        return ticket

    def end_prefill(self, ticket: PrefillTicket, *, learn: bool) -> None:
        """The prompt is processed (or abandoned). With ``learn``, its timing updates the speed
        estimate: the engine had ``ahead + tokens`` of prompt work to do before answering."""
        self.backlog_tokens = max(0, self.backlog_tokens - ticket.tokens)
        work = ticket.ahead + ticket.tokens
        if not learn or ticket.tokens < _MIN_LEARN_TOKENS:
            return
        sample = (time.monotonic() - ticket.started) / work
        old = self.prefill_s_per_token
        self.prefill_s_per_token = sample if old is None else old + _SPEED_ALPHA * (sample - old)

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

    def __init__(self, prefill: Iterable[str], decode: Iterable[str], *, stats_max_age_s: float = 5.0,
                 outlier: OutlierConfig | None = None) -> None:
        self.prefill: list[Endpoint] = []
        self.decode: list[Endpoint] = []
        self._by_url: dict[tuple[str, str], Endpoint] = {}
        self.stats_max_age_s = stats_max_age_s
        # Requests other gateway replicas have in flight per endpoint url (shared state), if any.
        self.others: Mapping[str, int] = {}
        self._release_waiters: list[asyncio.Future[None]] = []
        self.outlier = outlier or OutlierConfig()
        self.update(prefill, decode)

    def update(self, prefill: Iterable[str], decode: Iterable[str]) -> list[Endpoint]:
        """Take new endpoint lists (a config reload): endpoints kept keep their state (health, load,
        learned speed); requests in flight on removed ones finish normally. Returns the removed."""
        old = self._by_url
        self.prefill = [old.get(("prefill", u)) or Endpoint(u, "prefill") for u in prefill]
        self.decode = [old.get(("decode", u)) or Endpoint(u, "decode") for u in decode]
        self._by_url = {(e.pool, e.url): e for e in self.all()}
        for e in self.all():
            e.on_release = self._released
            e.outlier = self.outlier
        return [e for key, e in old.items() if key not in self._by_url]

    def all(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    def get(self, view: EndpointView) -> Endpoint:
        return self._by_url[(view.pool, view.url)]

    def snapshot(self) -> PoolSnapshot:
        now, age, others = time.monotonic(), self.stats_max_age_s, self.others
        return PoolSnapshot(tuple(e.view(now, age, others.get(e.url, 0)) for e in self.prefill),
                            tuple(e.view(now, age, others.get(e.url, 0)) for e in self.decode))

    def configure(self, stats_max_age_s: float, outlier: OutlierConfig) -> None:
        self.stats_max_age_s = stats_max_age_s
        self.outlier = outlier
        for e in self.all():
            e.outlier = outlier

    def _released(self) -> None:
        waiters, self._release_waiters = self._release_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_release(self, timeout: float) -> None:
        """Return when any endpoint's in-flight count drops, or after ``timeout`` seconds."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._release_waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            if fut in self._release_waiters:
                self._release_waiters.remove(fut)

    def ready(self) -> bool:
        return any(e.healthy and not e.ejected for e in self.decode)

    def block_size(self) -> int | None:
        """The KV block size the engines report (the first one known)."""
        now = time.monotonic()
        for e in self.all():
            if e.stats and e.stats.block_size and now - e.stats.at <= self.stats_max_age_s * 10:
                return e.stats.block_size
        return None


class HealthChecker:
    """Probes every endpoint's health path on an interval; an endpoint that keeps failing is
    skipped by routing until a probe succeeds again."""

    def __init__(self, pools: Pools, session: aiohttp.ClientSession, cfg: HealthConfig) -> None:
        self._pools = pools
        self._session = session
        self.configure(cfg)
        self._task: asyncio.Task | None = None

    def configure(self, cfg: HealthConfig) -> None:
        self._cfg = cfg
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)

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
