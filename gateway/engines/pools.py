"""Engine endpoints, their live state, and the health checker that keeps it current."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from gateway.background import cancel_checkpoint, stop_tasks
from gateway.config import HealthConfig, OutlierConfig
from policies.base import EndpointView, PoolSnapshot, Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine last reported on /metrics."""

    running: int
    waiting: int
    kv_usage: float | None
    block_size: int | None
    at: float  # time.monotonic() of the scrape
    prefix_caching: bool | None = None  # vllm:cache_config_info's enable_prefix_caching
    # Which run of the engine this is: its process start time (process_start_time_seconds), and a
    # counter that only a restart takes back (vllm:request_success_total).
    started_at: float | None = None
    served: float | None = None
    # vllm:cache_config_info's num_gpu_blocks and num_cpu_blocks: how many KV blocks the engine's
    # GPU cache (and vLLM's own CPU tier, when configured) can hold, which bounds what it can be
    # believed to hold.
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    # vllm:prompt_tokens_cached_by_source by source: prompt tokens served from each cache tier
    # (None: the engine does not count them)
    cached_by_source: dict[str, float] | None = None
    # vllm:lora_requests_info's newest series: --max-loras (None: LoRA off) and the adapters with
    # requests in flight
    lora_slots: int | None = None
    lora_active: frozenset[str] = frozenset()
    lora: bool = False  # LoRA is on (it can load adapters at run time, if allowed to)

    def restarted_since(self, old: EngineStats) -> bool:
        """Whether this report comes from another run of the engine than ``old``."""
        if self.started_at is not None and old.started_at is not None:
            return abs(self.started_at - old.started_at) > 0.5
        return self.served is not None and old.served is not None and self.served < old.served


@dataclass(slots=True)
class PrefillTicket:
    tokens: int
    ahead: int  # prompt tokens the gateway had already queued on the endpoint


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
    on_release: Callable[[str], None] | None = None  # the pools' "capacity freed" signal (with its pool)
    # The model names the engine's /v1/models lists (None: not known yet).
    served_models: frozenset[str] | None = None
    # Its LoRA adapters, from the same list: name -> (the path it loaded it from, the base model).
    adapters: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    was_up: bool = False  # it passed a health check at some point (a later down-and-up is a recovery)
    clock: Callable[[], float] = time.monotonic  # the pools' clock (tests inject one)
    # Passive health (outlier ejection), fed by the outcome of real requests.
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    consecutive_failures: int = 0
    outcomes: deque[bool] = field(default_factory=deque)
    ejected_until: float = 0.0
    ejections: int = 0  # in a row: each one lasts twice as long as the one before
    topology: Topology = ()  # where it runs (discovery or its config): pairing policies read it

    @property
    def ejected(self) -> bool:
        return self.clock() < self.ejected_until

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
            len(self.outcomes) >= cfg.min_requests and failed / len(self.outcomes) >= cfg.error_rate
        )
        if too_many and not self.ejected:
            seconds = min(cfg.base_ejection_s * 2**self.ejections, cfg.max_ejection_s)
            self.ejected_until = self.clock() + seconds
            self.ejections += 1
            self.consecutive_failures = 0
            self.outcomes.clear()
            log.warning("endpoint %s (%s) ejected for %.0f s after failed requests", self.url, self.pool, seconds)

    @property
    def prefix_caching_off(self) -> bool:
        """The engine said it runs without prefix caching: it never holds a prompt for later."""
        return self.stats is not None and self.stats.prefix_caching is False

    def view(
        self, now: float = 0.0, max_age_s: float = 0.0, others: int = 0, s_per_token: float | None = None
    ) -> EndpointView:
        """``others``: requests other gateway replicas have in flight here (shared state);
        ``s_per_token``: its measured prefill speed."""
        st = self.stats
        usable = self.healthy and not self.ejected
        if st is None or now - st.at > max_age_s:
            return EndpointView(
                self.url,
                self.pool,
                usable,
                self.in_flight + others,
                backlog_tokens=self.backlog_tokens,
                prefill_s_per_token=s_per_token,
                models=self.served_models,
                topology=self.topology,
            )
        return EndpointView(
            self.url,
            self.pool,
            usable,
            self.in_flight + others,
            st.running,
            st.waiting,
            st.kv_usage,
            self.backlog_tokens,
            s_per_token,
            self.served_models,
            self.topology,
            st.lora_slots,
            st.lora_active,
        )

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        if self.on_release is not None:
            self.on_release(self.pool)

    def start_prefill(self, tokens: int) -> PrefillTicket:
        """``tokens`` uncached prompt tokens are on their way here (the engine's prefill queue)."""
        ticket = PrefillTicket(tokens, self.backlog_tokens)
        self.backlog_tokens += tokens
        return ticket

    def end_prefill(self, ticket: PrefillTicket) -> None:
        """That prompt is processed (or abandoned)."""
        self.backlog_tokens = max(0, self.backlog_tokens - ticket.tokens)

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("endpoint %s (%s) marked unhealthy: %s", self.url, self.pool, why)
        self.healthy = False
        self.last_error = why

    def mark_up(self) -> None:
        if not self.healthy:
            log.info("endpoint %s (%s) is healthy", self.url, self.pool)
        self.healthy = True
        self.was_up = True
        self.last_error = ""


class Pools:
    """The prefill and decode pools; the only owner of endpoint state."""

    def __init__(
        self,
        prefill: Iterable[str],
        decode: Iterable[str],
        *,
        topology: Mapping[str, Topology] | None = None,
        stats_max_age_s: float = 5.0,
        outlier: OutlierConfig | None = None,
        prefill_speed: Callable[[str], float | None] = lambda url: None,
        on_restart: Callable[[Endpoint], None] = lambda ep: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefill: list[Endpoint] = []
        self.decode: list[Endpoint] = []
        self._by_url: dict[tuple[str, str], Endpoint] = {}
        self.stats_max_age_s = stats_max_age_s
        self._clock = clock  # monotonic seconds (tests inject a fake one)
        self._speed = prefill_speed  # the measured prefill speed per engine url
        self._on_restart = on_restart  # what forgets what was learned about an engine
        # Requests other gateway replicas have in flight per endpoint url (shared state), if any.
        self.others: Mapping[str, int] = {}
        self.release_listeners: list[Callable[[str], None]] = []  # told the pool of every freed slot
        self.served_version = 0  # counts changes of what the engines serve (derived lookups cache on it)
        # told of every fresh /metrics report, and whether it comes from a new run of the engine
        self.report_listeners: list[Callable[[Endpoint, EngineStats, bool], None]] = []
        self.outlier = outlier or OutlierConfig()
        # not_serving's answers, per model and loadability
        self._not_serving: dict[tuple[str, bool], frozenset[tuple[str, str]]] = {}
        self.update(prefill, decode, topology)

    def update(
        self, prefill: Iterable[str], decode: Iterable[str], topology: Mapping[str, Topology] | None = None
    ) -> list[Endpoint]:
        """Take new endpoint lists (a config reload, a discovery change): endpoints kept keep their
        state (health, load, learned speed) and take their new ``topology`` (by URL); requests in
        flight on removed ones finish normally. Returns the removed."""
        old = self._by_url
        self.prefill = [old.get(("prefill", u)) or Endpoint(u, "prefill") for u in prefill]
        self.decode = [old.get(("decode", u)) or Endpoint(u, "decode") for u in decode]
        self._by_url = {(e.pool, e.url): e for e in self.all()}
        self._refresh_beliefs()
        where = topology or {}
        for e in self.all():
            e.on_release = self._released
            e.outlier = self.outlier
            e.clock = self._clock
            e.topology = where.get(e.url, ())
        return [e for key, e in old.items() if key not in self._by_url]

    def all(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    def get(self, view: EndpointView) -> Endpoint:
        return self._by_url[(view.pool, view.url)]

    def caching_off(self, url: str) -> bool:
        """The engine at ``url`` runs without prefix caching (its /metrics say so)."""
        return url in self.caching_off_urls

    def not_serving(self, model: str, *, loadable: bool = False) -> frozenset[tuple[str, str]]:
        """(pool, url) of the endpoints whose /v1/models lacks ``model`` (computed once per change);
        ``loadable``: ``model`` is a LoRA adapter the gateway may load, so an engine with LoRA on
        (its metrics report adapter slots) is not one of them."""
        key = (model, loadable)
        gaps = self._not_serving.get(key)
        if gaps is None:
            gaps = self._not_serving[key] = frozenset(
                (e.pool, e.url)
                for e in self.all()
                if e.served_models is not None
                and model not in e.served_models
                and not (loadable and e.stats is not None and e.stats.lora)
            )
        return gaps

    def set_served(
        self, ep: Endpoint, models: frozenset[str] | None, adapters: Mapping[str, tuple[str, str]] | None = None
    ) -> None:
        """What ``ep`` serves (its /v1/models; None: not known), and which of it are LoRA adapters."""
        ep.served_models = models
        if adapters is not None or models is None:
            ep.adapters = adapters or {}
        self._not_serving = {}
        self.served_version += 1

    def _refresh_beliefs(self) -> None:
        """Derived per-request lookups: keep them in step with endpoint changes."""
        self.caching_off_urls = frozenset(e.url for e in self.all() if e.prefix_caching_off)
        self._not_serving = {}

    def snapshot(self) -> PoolSnapshot:
        now, age, others, speed = self._clock(), self.stats_max_age_s, self.others, self._speed
        return PoolSnapshot(
            tuple(e.view(now, age, others.get(e.url, 0), speed(e.url)) for e in self.prefill),
            tuple(e.view(now, age, others.get(e.url, 0), speed(e.url)) for e in self.decode),
        )

    def report(self, ep: Endpoint, stats: EngineStats) -> None:
        """A fresh /metrics report; one from another run of the engine (it restarted, and its
        cache, speed and served models may have changed) makes everything learned about it go."""
        old, ep.stats = ep.stats, stats
        if (old.prefix_caching if old else None) != stats.prefix_caching:
            self._refresh_beliefs()
        elif (old.lora if old else None) != stats.lora:
            self._not_serving = {}  # whether it can load adapters changed
        restarted = old is not None and stats.restarted_since(old)
        if restarted:
            self.restarted(ep, "its /metrics show a new process")
        for listener in self.report_listeners:
            listener(ep, stats, restarted)

    def restarted(self, ep: Endpoint, why: str) -> None:
        log.warning("endpoint %s (%s) restarted (%s): forgetting what was learned about it", ep.url, ep.pool, why)
        self.set_served(ep, None)
        self._on_restart(ep)

    def configure(self, stats_max_age_s: float, outlier: OutlierConfig) -> None:
        self.stats_max_age_s = stats_max_age_s
        self.outlier = outlier
        for e in self.all():
            e.outlier = outlier

    def _released(self, pool: str) -> None:
        for listener in self.release_listeners:
            listener(pool)

    def ready(self) -> bool:
        return any(e.healthy and not e.ejected for e in self.decode)

    def gpu_blocks(self, url: str) -> int | None:
        """How many KV blocks ``url``'s GPU cache holds, as the engine last reported (None: unknown)."""
        for e in self.all():
            if e.url == url and e.stats is not None and e.stats.gpu_blocks:
                return e.stats.gpu_blocks
        return None

    def cpu_blocks(self, url: str) -> int | None:
        """How many KV blocks ``url``'s own CPU tier holds (vLLM's num_cpu_blocks; None: unknown or none)."""
        for e in self.all():
            if e.url == url and e.stats is not None and e.stats.cpu_blocks:
                return e.stats.cpu_blocks
        return None

    def block_size(self) -> int | None:
        """The KV block size the engines report (the first one known)."""
        now = self._clock()
        for e in self.all():
            if e.stats and e.stats.block_size and now - e.stats.at <= self.stats_max_age_s * 10:
                return e.stats.block_size
        return None


class HealthChecker:
    """Probes every endpoint's health path on an interval; an endpoint that keeps failing is
    skipped by routing until a probe succeeds again. An endpoint that comes up goes through
    ``on_up(ep, recovering)`` before routing sees it (``recovering``: it was up before, then down:
    is it the same run of the engine?), and so does a healthy one whose served models are unknown."""

    # How old the decode pool's last probe may be when /ready answers (``fresh``): a readiness
    # probe right after every decode engine died says so, not what the last round saw.
    READY_MAX_AGE_S = 0.25
    READY_BOUND_S = 0.5  # and the most /ready waits for that probe (a probe's own timeout is longer)

    def __init__(
        self,
        pools: Pools,
        session: aiohttp.ClientSession,
        cfg: HealthConfig,
        on_up: Callable[[Endpoint, bool], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = pools
        self._session = session
        self._on_up = on_up
        self._clock = clock
        self._wake = asyncio.Event()
        self.configure(cfg)
        self._task: asyncio.Task[None] | None = None
        self._decode_probed = -math.inf  # when the decode pool's last probe round began
        self._refresh: asyncio.Task[None] | None = None  # the round /ready callers share

    def configure(self, cfg: HealthConfig) -> None:
        """Takes effect at once: a new interval ends the current wait."""
        self._cfg = cfg
        self._timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        self._wake.set()

    async def probe(self, ep: Endpoint) -> None:
        try:
            async with self._session.get(ep.url + self._cfg.path, timeout=self._timeout) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            ok, why = False, f"health check failed: {type(err).__name__}"
            if _refused(err):  # nothing listens: the engine is gone, not busy (a busy one still accepts)
                ok, why = False, "health check: connection refused"
        if ok:
            ep.failed_probes = 0
            if self._on_up is not None and (not ep.healthy or ep.served_models is None):
                await self._on_up(ep, not ep.healthy and ep.was_up)
            ep.mark_up()
            return
        ep.failed_probes += 1
        # A busy engine can miss one probe; only a run of failures (or a refused connection) takes it out.
        if ep.failed_probes >= self._cfg.failures_to_mark_down or not ep.healthy or why.endswith("refused"):
            ep.mark_down(why)

    async def probe_all(self) -> None:
        self._decode_probed = self._clock()
        await asyncio.gather(*(self.probe(ep) for ep in self._pools.all()))

    async def fresh(self) -> None:
        """Before /ready answers: the decode pool probed within ``READY_MAX_AGE_S``. Concurrent
        callers share one round, so a flood of /ready costs the engines at most one probe each
        per ``READY_MAX_AGE_S``; a caller waits at most ``READY_BOUND_S``, then the answer is
        what is known (the round goes on)."""
        if self._task is None or self._clock() - self._decode_probed < self.READY_MAX_AGE_S:
            return
        if self._refresh is None or self._refresh.done():
            self._decode_probed = self._clock()
            self._refresh = asyncio.create_task(self._probe_decode(), name="health-ready-refresh")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.READY_BOUND_S):
                await asyncio.shield(self._refresh)

    async def _probe_decode(self) -> None:
        with contextlib.suppress(Exception):  # logged by the next round if it persists
            await asyncio.gather(*(self.probe(ep) for ep in self._pools.decode))

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the wake fires
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._cfg.interval_s):
                    await self._wake.wait()
            try:
                await self.probe_all()
            except Exception:  # one bad round must not stop health checking for good (not BaseException)
                log.exception("health check round failed")
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)

    async def start(self) -> None:
        await self.probe_all()  # so /ready is truthful from the first request
        self._task = asyncio.create_task(self._run(), name="health-checker")

    async def stop(self) -> None:
        """Bounded (gateway/background.py): a stuck probe or a swallowed cancel cannot hang shutdown."""
        task, self._task = self._task, None
        refresh, self._refresh = self._refresh, None
        await stop_tasks([task, refresh])


def _refused(err: BaseException) -> bool:
    """A connection refused (nothing listens on the port), through aiohttp's wrapping."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        os_error = getattr(seen, "os_error", None)
        seen = os_error if isinstance(os_error, BaseException) else seen.__cause__
    return False
