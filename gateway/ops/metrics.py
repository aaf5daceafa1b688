"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gateway.cluster.redis_state import RedisState
from gateway.engines.kvevents import KVEventSubscriber
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage
from gateway.http.auth import authorize_admin
from gateway.http.errors import APIError
from gateway.ops.requestlog import RequestRecord
from gateway.tokenization import fasttok
from policies.base import LegReport, RequestContext
from policies.beliefs.prefix_index import PrefixStore

if TYPE_CHECKING:
    from starlette.requests import Request

    from gateway.cluster.workerbus import WorkerBus
    from gateway.engines.discovery import SliceWatcher
    from gateway.engines.modelcheck import ServedModels
    from gateway.fairness.admission import Gate, LoopLag
    from gateway.http.server import Connections

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    2.5,
)
FAILOVER_EVENTS = ("prefill_retried", "prefill_fallback_direct", "decode_retried")
FAILOVER_CAUSES = ("engine_unreachable", "engine_timeout", "engine_error")
# A decode leg that fails after its first token: why (the connection broke, the engine went silent,
# it sent an error event or an unreadable one, its stream ended early, a continuation did not
# reproduce the text sent) and what became of the answer.
MIGRATION_REASONS = ("disconnected", "timeout", "error_event", "bad_event", "ended", "diverged")
MIGRATION_RESULTS = ("ok", "failed", "skipped", "abandoned")
_STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# How far off a wrong belief was, in cached prompt tokens (a block is 16-128 tokens on vLLM).
_BELIEF_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


def authorize_scrape(request: Request, protect: bool, token: str | None) -> None:
    """``admin.protect_metrics``: a scrape must carry the admin bearer token. Raises 401 without it,
    and always when no token could be read (an empty file or variable): closed, never open."""
    if not protect:
        return
    if token is None:
        raise APIError(
            401,
            "A valid admin bearer token is required (none is configured).",
            type_="authentication_error",
            code="invalid_admin_token",
        )
    authorize_admin(request, token)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        pools: Pools,
        index: PrefixStore | None = None,
        feeds: Callable[[], Sequence[KVEventSubscriber]] = list,
        shared: RedisState | None = None,
        watchers: Callable[[], Iterable[SliceWatcher]] = tuple,
        prefill_speed: Callable[[str], float | None] = lambda url: None,
        models: ServedModels | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pools = pools
        self.registry.register(_RoutingStateCollector(pools, index, feeds, shared, prefill_speed))
        self.registry.register(_DiscoveryCollector(watchers))
        self.registry.register(_PoolCollector(pools))
        self.registry.register(_FastTokenizerCollector())
        GCCollector(registry=self.registry)  # python_gc_*: collections by generation (gateway/ops/gcpolicy.py)
        ProcessCollector(registry=self.registry)  # process_*: CPU seconds, resident memory, open fds
        if models is not None:
            self.registry.register(_ModelsCollector(models, pools))
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        r = self.registry
        # What clients see, per model and path taken (pd, direct; none: answered by the gateway).
        self.requests = Counter(
            "pdgate_requests",
            "Client requests by model, path taken and HTTP status",
            ["model", "path", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "pdgate_request_duration_seconds",
            "End-to-end latency: request received to last byte sent",
            ["model", "path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pdgate_time_to_first_token_seconds",
            "Streams: request received to the first token sent to the client",
            ["model", "path"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdgate_inter_token_latency_seconds",
            "Streams: time between consecutive chunks sent to the client",
            ["model", "path"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdgate_prompt_tokens",
            "Prompt tokens of answered requests (gateway's count)",
            ["model", "path"],
            registry=r,
        )
        self.output_tokens = Counter(
            "pdgate_output_tokens",
            "Output tokens sent (the engine's usage; for streams without usage, chunks)",
            ["model", "path"],
            registry=r,
        )
        # P/D internals.
        self.prefill_leg = Histogram(
            "pdgate_prefill_leg_duration_seconds",
            "Prefill leg: sent to kv_transfer_params received (queue + prefill)",
            ["model", "outcome"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.decode_first_token = Histogram(
            "pdgate_decode_first_token_seconds",
            "Streams: decode leg sent to its first token (on the pd path mostly the KV pull)",
            ["model", "path"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "pdgate_route_decisions", "Routing decisions by path and reason", ["path", "reason"], registry=r
        )
        self.failovers = Counter(
            "pdgate_failovers",
            "Failovers by event (prefill_retried, prefill_fallback_direct, decode_retried) "
            "and cause (engine_unreachable, engine_timeout, engine_error)",
            ["event", "cause"],
            registry=r,
        )
        self.tokenize = Histogram(
            "pdgate_tokenize_duration_seconds",
            "Parsing, chat template and tokenizing",
            ["model"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.decision_time = Histogram(
            "pdgate_route_decision_duration_seconds",
            "Hashing, prefix lookup and the policy pipeline (no queueing)",
            ["model"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "pdgate_admission_wait_seconds",
            "Time requests waited for admission and engine capacity",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "pdgate_admission_rejected",
            "Requests answered 429 by admission, by reason "
            "(queue_timeout: no slot in time; overloaded: the event loop ran late)",
            ["reason"],
            registry=r,
        )
        self.reloads = Counter(
            "pdgate_config_reloads", "Config file reloads by result (ok, rejected)", ["result"], registry=r
        )
        self.config_info = Gauge(
            "pdgate_config_info", "1 for the version of the config in use", ["version"], registry=r
        )
        # How accurate routing's beliefs are (docs/operations.md, "Routing beliefs").
        self.belief_error = Histogram(
            "pdgate_prefix_belief_error_tokens",
            "Wrong beliefs: how many cached prompt tokens the gateway believed an engine held beyond (over) or "
            "short of (under) what the engine reported serving from its cache",
            ["pool", "direction"],
            buckets=_BELIEF_BUCKETS,
            registry=r,
        )
        self.belief_checks = Counter(
            "pdgate_prefix_belief_checks",
            "Engine-reported cache hits compared with the gateway's belief, by result "
            "(exact, over: believed more, under: believed less)",
            ["pool", "result"],
            registry=r,
        )
        self.restarts = Counter(
            "pdgate_endpoint_restarts",
            "Engine restarts detected (what the gateway had learned about them was dropped)",
            ["pool"],
            registry=r,
        )
        self.hook_errors = Counter(
            "pdgate_hook_errors",
            "Lifecycle hooks that raised, by subscriber and hook",
            ["subscriber", "hook"],
            registry=r,
        )
        # Mid-stream migration (docs/operations.md, "Mid-stream migration").
        self.migrations = Counter(
            "pdgate_migrations",
            "Decode legs that failed after their first token, by reason (disconnected, timeout, "
            "error_event, bad_event, ended, diverged) and result (ok: the answer went on on another engine to its "
            "end; failed: the continuation failed too; skipped: not migrated, see pdgate_migrations_skipped_total; "
            "abandoned: the client left first)",
            ["reason", "result"],
            registry=r,
        )
        self.migrations_skipped = Counter(
            "pdgate_migrations_skipped",
            "Answers cut mid-way that were not migrated, by why (disabled; the request: "
            "guided_decoding, tools, logprobs, multiple_sequences, ...; limit, deadline, no_token_ids, "
            "no_resume_point, parsed_output)",
            ["why"],
            registry=r,
        )
        self.migrated_tokens = Counter(
            "pdgate_migrated_tokens",
            "Generated tokens carried into continuations (their KV pulled or computed again)",
            ["model"],
            registry=r,
        )
        self.migration_time = Histogram(
            "pdgate_migration_duration_seconds",
            "From a decode leg's failure to its continuation's first token, by "
            "the continuation's path: the gap a migrated stream shows",
            ["model", "path"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        # Fairness, per tenant (the top N by first sight, the rest "other") and priority class.
        self.tenant_requests = Counter(
            "pdgate_tenant_requests",
            "Requests by tenant, priority class and outcome (admitted: sent to an engine; "
            "shed: 429, its TTFT objective could not be met; rejected: 429, no room in time; error: any other)",
            ["tenant", "priority", "outcome"],
            registry=r,
        )
        self.tenant_queue = Histogram(
            "pdgate_tenant_queue_seconds",
            "Time admitted requests waited for room",
            ["tenant", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_prefill_tokens = Counter(
            "pdgate_tenant_prefill_tokens",
            "Uncached prompt tokens sent to the prefill pool",
            ["tenant", "priority"],
            registry=r,
        )
        # Known label values start at 0, so rate() and alerts see the series before the first event.
        for result in ("ok", "rejected"):
            self.reloads.labels(result)
        for reason in ("queue_timeout", "overloaded", "queue_full", "tenant_queue_full"):
            self.rejections.labels(reason)
        for event in FAILOVER_EVENTS:
            for cause in FAILOVER_CAUSES:
                self.failover_child(event, cause)
        for reason in MIGRATION_REASONS:
            for result in MIGRATION_RESULTS:
                self.migrations.labels(reason, result)
        for pool in ("prefill", "decode"):
            self.restarts.labels(pool)
            for result in ("exact", "over", "under"):
                self.belief_checks.labels(pool, result)

    def _child(self, metric: Any, *labels: str) -> Any:
        """prometheus_client's labels() costs microseconds a call: look each label set up once."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record(self, rec: RequestRecord) -> None:
        """Everything one request measured, once it is over (off the relay's per-chunk path)."""
        model, path = rec.model, rec.path
        self._child(self.requests, model, path, str(rec.status)).inc()
        self._child(self.duration, model, path).observe(rec.e2e_s)
        if rec.admitted:
            self.queue_wait.observe(rec.queue_s)
        if rec.tenant_label:
            status = rec.status
            outcome = (
                "admitted"
                if rec.path != "none"
                else "shed"
                if rec.reason == "ttft_objective"
                else "rejected"
                if status == 429
                else "error"
            )
            if outcome != "shed":  # counted when shed (tenant_shed)
                self._child(self.tenant_requests, rec.tenant_label, rec.priority, outcome).inc()
            if rec.admitted and rec.path != "none":
                self._child(self.tenant_queue, rec.tenant_label, rec.priority).observe(rec.queue_s)
        if rec.tokenize_s is not None:
            self._child(self.tokenize, model).observe(rec.tokenize_s)
        if rec.route_s is not None:
            self._child(self.decision_time, model).observe(rec.route_s)
        for outcome, seconds in rec.prefill_legs:  # every attempt, failed ones too
            self.prefill_attempt(model, outcome, seconds)
        if rec.status >= 400 or path == "none":
            return
        self._child(self.prompt_tokens, model, path).inc(rec.prompt_tokens)
        if rec.output_tokens:
            self._child(self.output_tokens, model, path).inc(rec.output_tokens)
        if rec.ttft_s is not None:
            self._child(self.ttft, model, path).observe(rec.ttft_s)
        if rec.decode_first_token_s is not None:
            self._child(self.decode_first_token, model, path).observe(rec.decode_first_token_s)

    def prefill_attempt(self, model: str, outcome: str, seconds: float) -> None:
        """One prefill leg ended (a migration's continuation's too, as it ends)."""
        self._child(self.prefill_leg, model, outcome).observe(seconds)

    def itl_for(self, model: str, path: str) -> Any:
        """The inter-token histogram a stream observes chunk by chunk (nothing kept per chunk)."""
        return self._child(self.itl, model, path)

    def failover_child(self, event: str, cause: str) -> Any:
        return self._child(self.failovers, event, cause)

    def failover(self, event: str, cause: str) -> None:
        self.failover_child(event, cause).inc()

    def migration(self, reason: str, result: str, why: str = "") -> None:
        """A decode leg failed after its first token (``why``: why it was not migrated, if not)."""
        self._child(self.migrations, reason, result).inc()
        if why:
            self._child(self.migrations_skipped, why).inc()

    def migrated(self, model: str, path: str, tokens: int, seconds: float) -> None:
        """A continuation's first token arrived, ``seconds`` after the failure, ``tokens`` carried."""
        self._child(self.migrated_tokens, model).inc(tokens)
        self._child(self.migration_time, model, path).observe(seconds)

    def tenant_shed(self, tenant: str, priority: str) -> None:
        self._child(self.tenant_requests, tenant, priority, "shed").inc()

    def tenant_prefill(self, tenant: str, priority: str, tokens: int) -> None:
        self._child(self.tenant_prefill_tokens, tenant, priority).inc(tokens)

    def watch_tenants(
        self, usage: Usage, labels: Callable[[str], str], queues: Callable[[], Iterable[tuple[str, int]]] = tuple
    ) -> None:
        self.registry.register(_TenantCollector(usage, labels, queues))

    def watch_bus(self, bus: WorkerBus) -> None:
        """Export what the workers' hub dropped (gateway/cluster/workerbus.py), read at scrape time."""
        self.registry.register(_BusCollector(bus))

    def decided(self, path: str, reason: str) -> None:
        self._child(self.decisions, path, reason).inc()

    def watch_admission(self, gate: Gate, connections: Connections | None, lag: LoopLag | None = None) -> None:
        """Export the admission slots, the event loop's lag and the HTTP server's connections (read
        at scrape time)."""
        self.registry.register(_AdmissionCollector(gate, connections, lag))

    def rejected(self, reason: str) -> None:
        self._child(self.rejections, reason).inc()

    def watch_planner(self, exported: Callable[[], dict[str, Any] | None]) -> None:
        """Export the live planner's recommendation (gateway/ops/live_planner.py), read at scrape time."""
        self.registry.register(_PlannerCollector(exported))

    def hook_failed(self, subscriber: str, hook: str) -> None:
        self.hook_errors.labels(subscriber, hook).inc()

    def restarted(self, pool: str) -> None:
        self.restarts.labels(pool).inc()

    def config_loaded(self, version: str) -> None:
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """Per pool, the signals to scale it on (docs/operations.md, "Scaling each pool on its own
    signal"). Engine-reported figures count only endpoints whose last scrape is fresh: stale data
    ages out instead of lingering.
    Built at scrape time, so engines that left (a reload, discovery) leave no series behind."""

    def __init__(self, pools: Pools) -> None:
        self._pools = pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["pool"])

        healthy = family("pdgate_pool_healthy_endpoints", "Endpoints passing health checks and not ejected")
        in_flight = family("pdgate_pool_in_flight_requests", "Requests this gateway has open on the pool's engines")
        uncached = family(
            "pdgate_pool_uncached_prompt_tokens",
            "Uncached prompt tokens this gateway sent to the pool whose prefill has not finished",
        )
        waiting = family("pdgate_pool_engine_waiting_requests", "Waiting requests the pool's engines report")
        running = family("pdgate_pool_engine_running_requests", "Running requests the pool's engines report")
        kv = family("pdgate_pool_kv_usage_ratio", "Mean KV cache usage (0..1) the pool's engines report")
        reporting = family("pdgate_pool_reporting_endpoints", "Endpoints whose engine metrics are fresh")
        ep_labels = ["pool", "engine"]  # not "endpoint": the Prometheus Operator sets that to the port name
        ep_healthy = GaugeMetricFamily(
            "pdgate_endpoint_healthy", "1 when the engine passes health checks", labels=ep_labels
        )
        ep_in_flight = GaugeMetricFamily(
            "pdgate_endpoint_in_flight_requests", "Requests the gateway has open on the engine", labels=ep_labels
        )
        for e in self._pools.all():
            ep_healthy.add_metric([e.pool, e.url], 1 if e.healthy else 0)
            ep_in_flight.add_metric([e.pool, e.url], e.in_flight)
        now = time.monotonic()
        max_age = self._pools.stats_max_age_s
        for name, eps in (("prefill", self._pools.prefill), ("decode", self._pools.decode)):
            fresh = [e.stats for e in eps if e.stats is not None and now - e.stats.at <= max_age]
            usages = [s.kv_usage for s in fresh if s.kv_usage is not None]
            healthy.add_metric([name], sum(1 for e in eps if e.healthy and not e.ejected))
            in_flight.add_metric([name], sum(e.in_flight for e in eps))
            uncached.add_metric([name], sum(e.backlog_tokens for e in eps))
            reporting.add_metric([name], len(fresh))
            # No fresh report: no value at all, rather than a 0 that would tell an autoscaler the
            # pool is idle when its engines are too busy to answer scrapes.
            if fresh:
                waiting.add_metric([name], sum(s.waiting for s in fresh))
                running.add_metric([name], sum(s.running for s in fresh))
            if usages:
                kv.add_metric([name], sum(usages) / len(usages))
        yield from (healthy, in_flight, uncached, waiting, running, kv, reporting, ep_healthy, ep_in_flight)


class _DiscoveryCollector:
    """Per pool with Kubernetes discovery: what its EndpointSlice watch found, and whether it works
    (a watch that keeps failing leaves the pool on the last endpoints it saw)."""

    def __init__(self, watchers: Callable[[], Iterable[SliceWatcher]]) -> None:
        self._watchers = watchers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        synced = GaugeMetricFamily(
            "pdgate_discovery_synced", "1 once the pool's first EndpointSlice list completed", labels=["pool"]
        )
        found = GaugeMetricFamily(
            "pdgate_discovery_endpoints", "Ready endpoints the pool's EndpointSlices list", labels=["pool"]
        )
        lists = CounterMetricFamily(
            "pdgate_discovery_lists", "Full EndpointSlice lists (the first, and one per 410)", labels=["pool"]
        )
        errors = CounterMetricFamily(
            "pdgate_discovery_errors", "Failed EndpointSlice lists or watches", labels=["pool"]
        )
        for w in self._watchers():
            synced.add_metric([w.pool], 1 if w.synced.is_set() else 0)
            found.add_metric([w.pool], len(w.endpoints))
            lists.add_metric([w.pool], w.lists)
            errors.add_metric([w.pool], w.errors)
        yield from (synced, found, lists, errors)


class _RoutingStateCollector:
    """Routing state read at scrape time: the prefix index, the KV event feeds, engine signals."""

    def __init__(
        self,
        pools: Pools,
        index: PrefixStore | None,
        feeds: Callable[[], Sequence[KVEventSubscriber]],
        shared: RedisState | None,
        prefill_speed: Callable[[str], float | None],
    ) -> None:
        self._pools, self._index, self._feeds, self._shared = pools, index, feeds, shared
        self._speed = prefill_speed

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        backlog = GaugeMetricFamily(
            "pdgate_endpoint_backlog_tokens",
            "Uncached prompt tokens the gateway sent to the endpoint whose prefill has not finished",
            labels=["pool", "engine"],
        )
        speed = GaugeMetricFamily(
            "pdgate_endpoint_prefill_seconds_per_token",
            "Prefill speed measured on the engine's prefill legs",
            labels=["pool", "engine"],
        )
        for ep in self._pools.all():
            backlog.add_metric([ep.pool, ep.url], ep.backlog_tokens)
            if (spt := self._speed(ep.url)) is not None:
                speed.add_metric([ep.pool, ep.url], spt)
        yield backlog
        yield speed
        if self._index is not None:
            st = self._index.stats()
            blocks = GaugeMetricFamily(
                "pdgate_prefix_index_blocks",
                "(endpoint, block) entries in the prefix index by source",
                labels=["source"],
            )
            blocks.add_metric(["learned"], st.approximate)
            blocks.add_metric(["kv_events"], st.precise)
            yield blocks
        connected = GaugeMetricFamily(
            "pdgate_kv_events_connected", "1 while the engine's KV event feed is connected", labels=["engine"]
        )
        events = CounterMetricFamily(
            "pdgate_kv_events", "KV cache events applied to the prefix index", labels=["engine"]
        )
        gaps = CounterMetricFamily("pdgate_kv_events_gaps", "Sequence gaps seen on a KV event feed", labels=["engine"])
        invalid = CounterMetricFamily(
            "pdgate_kv_events_invalid",
            "KV event messages refused: not a KV event batch, or over routing.prefix.max_event_batch_blocks",
            labels=["engine"],
        )
        disconnects = CounterMetricFamily(
            "pdgate_kv_events_disconnects",
            "KV event feed connections lost (also: a message over routing.prefix.max_event_message_bytes)",
            labels=["engine"],
        )
        for feed in self._feeds():
            c = feed.counters
            connected.add_metric([feed.url], 1 if c.connected else 0)
            events.add_metric([feed.url], c.events_applied)
            gaps.add_metric([feed.url], c.gaps)
            invalid.add_metric([feed.url], c.decode_errors)
            disconnects.add_metric([feed.url], c.disconnects)
        yield connected
        yield events
        yield gaps
        yield invalid
        yield disconnects
        if self._shared is not None:
            up = GaugeMetricFamily(
                "pdgate_shared_state_up",
                "1 while the shared state backend (Redis) answers; 0: routing on local state",
                labels=["backend"],
            )
            up.add_metric(["redis"], 1 if self._shared.status.healthy else 0)
            yield up
            errors = CounterMetricFamily("pdgate_shared_state_errors", "Failed or timed-out Redis operations")
            errors.add_metric([], self._shared.errors)
            yield errors
            dropped = CounterMetricFamily(
                "pdgate_shared_state_dropped_writes", "Learned-prefix writes dropped because Redis could not keep up"
            )
            dropped.add_metric([], self._shared.dropped_writes)
            yield dropped


class _ModelsCollector:
    """Per engine, each configured model it does not serve (by its /v1/models): alert on any series."""

    def __init__(self, models: ServedModels, pools: Pools) -> None:
        self._models, self._pools = models, pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        missing = GaugeMetricFamily(
            "pdgate_endpoint_model_missing",
            "1 for each configured model the engine's /v1/models does not list",
            labels=["pool", "engine", "model"],
        )
        for ep in self._pools.all():
            for model in self._models.missing(ep):
                missing.add_metric([ep.pool, ep.url, model], 1)
        yield missing


class BeliefAudit:
    """A lifecycle subscriber comparing what routing believed an engine held in its prefix cache
    with what the engine says it served from it. Prefill legs (vLLM's handle carries the prefill
    engine's hit) and direct decode legs (usage.prompt_tokens_details.cached_tokens, with
    --enable-prompt-tokens-details); a decode leg on the P/D path reports the prefill engine's hit."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        if leg.cached_tokens is None or not ctx.block_size:
            return
        error = ctx.cached(leg.url) - leg.cached_tokens
        m = self._metrics
        result = "exact" if error == 0 else "over" if error > 0 else "under"
        m._child(m.belief_checks, leg.leg, result).inc()
        if error:
            m._child(m.belief_error, leg.leg, result).observe(abs(error))


class _PlannerCollector:
    """The engines each pool needs for this gateway's traffic (planner.enabled), in fractions of an
    engine: sum them over gateway replicas and scale each pool to the ceiling."""

    def __init__(self, exported: Callable[[], dict[str, Any] | None]) -> None:
        self._exported = exported

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rec = self._exported()
        if rec is None:
            return
        desired = GaugeMetricFamily(
            "pdgate_pool_desired_engines",
            "Engines the pool needs for this gateway's "
            "share of the traffic to meet the planner's SLOs (fractional: sum over "
            "replicas)",
            labels=["pool"],
        )
        desired.add_metric(["prefill"], rec["prefill"])
        desired.add_metric(["decode"], rec["decode"])
        seen = GaugeMetricFamily("pdgate_planner_window_requests", "Requests the planner's last answer was for")
        seen.add_metric([], rec["requests"])
        took = GaugeMetricFamily("pdgate_planner_compute_seconds", "How long the planner's last answer took")
        took.add_metric([], rec["compute_s"])
        unmet = GaugeMetricFamily(
            "pdgate_planner_unmet",
            "1 when the last round could not meet every SLO: "
            "requests no number of engines serves in time, or none the model considers "
            "(the desired figures keep the last answer)",
        )
        unmet.add_metric([], rec["unmet"])
        unservable = GaugeMetricFamily(
            "pdgate_planner_unservable_requests",
            "Requests of the window whose SLO no number of engines meets (prefill alone is longer than their TTFT)",
        )
        unservable.add_metric([], rec["unservable"])
        failures = CounterMetricFamily(
            "pdgate_planner_failures", "Planner rounds without an answer (an error, or past interval_s)"
        )
        failures.add_metric([], rec["failures"])
        yield from (desired, seen, took, unmet, unservable, failures)


class _AdmissionCollector:
    """Slots held and waited for (admission.max_in_flight), and the server's connections."""

    def __init__(self, gate: Gate, connections: Connections | None, lag: LoopLag | None) -> None:
        self._gate, self._connections, self._lag = gate, connections, lag

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "pdgate_admission_in_flight", "Requests holding an admission slot (their body read, not yet answered)"
        )
        held.add_metric([], self._gate.in_flight)
        queued = GaugeMetricFamily("pdgate_admission_queued", "Requests waiting for an admission slot")
        queued.add_metric([], self._gate.queued)
        yield from (held, queued)
        if self._lag is not None:
            lag = GaugeMetricFamily(
                "pdgate_event_loop_lag_seconds",
                "How late the gateway serves: its event "
                "loop's lateness or new requests' wait before they are read, the worse (smoothed; "
                "admission answers 429 above admission.max_loop_lag_ms)",
            )
            lag.add_metric([], self._lag.behind_s)
            peak = GaugeMetricFamily("pdgate_event_loop_lag_max_seconds", "The largest event loop delay seen")
            peak.add_metric([], self._lag.peak_s)
            yield from (lag, peak)
        if self._connections is not None:
            open_ = GaugeMetricFamily("pdgate_http_connections", "Open client connections")
            open_.add_metric([], self._connections.open)
            refused = CounterMetricFamily(
                "pdgate_http_connections_refused", "Connections refused at server.max_connections"
            )
            refused.add_metric([], self._connections.refused)
            yield from (open_, refused)


class _BusCollector:
    """Messages a worker dropped from the hub, by reason: not from this gateway's workers
    (``forged``), an authentic message seen before (``replayed``), or one that broke the protocol
    (``invalid``: a bug or two versions side by side)."""

    def __init__(self, bus: WorkerBus) -> None:
        self._bus = bus

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        dropped = CounterMetricFamily(
            "pdgate_worker_bus_dropped_messages",
            "Messages from the workers' hub dropped by reason (forged, replayed, invalid)",
            labels=["reason"],
        )
        for reason, n in self._bus.dropped.items():
            dropped.add_metric([reason], n)
        yield dropped


class _FastTokenizerCollector:
    """Texts whose fast (tiktoken) ids differed from the Rust tokenizer's, per model: any turns that
    model's checked fast path off (``gateway.tokenization.fasttok``). Process-wide counts, read at scrape time."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "pdgate_tokenizer_fastpath_mismatches",
            "Texts whose fast-path token ids differed from the Rust tokenizer's (load-time self-check or "
            "run-time sample); the model's fast path is off after one",
            labels=["model"],
        )
        for model, count in sorted(fasttok.mismatches().items()):
            family.add_metric([model], count)
        yield family


class _TenantCollector:
    """Each tenant's use of the pools, as fair queueing sees it (this replica's and the others')."""

    def __init__(
        self, usage: Usage, labels: Callable[[str], str], queues: Callable[[], Iterable[tuple[str, int]]]
    ) -> None:
        self._usage, self._labels, self._queues = usage, labels, queues

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        decode = GaugeMetricFamily(
            "pdgate_tenant_decode_occupancy",
            "Expected output tokens of the tenant's "
            "running decode legs (running sequences x expected output), all replicas",
            labels=["tenant"],
        )
        prefill = GaugeMetricFamily(
            "pdgate_tenant_prefill_use",
            "Prefill tokens the tenant sent recently "
            "(fading by half every fairness.half_life_s), all replicas: fair queueing's "
            "order for the prefill pool",
            labels=["tenant"],
        )
        taken = GaugeMetricFamily(
            "pdgate_tenant_decode_use",
            "Decode occupancy the tenant took recently (expected "
            "output tokens per leg started, settled to the tokens produced at the request's "
            "end; fading likewise), all replicas: the decode pool's order",
            labels=["tenant"],
        )
        sums: dict[str, list[float]] = {}
        for tenant in self._usage.tenants():
            row = sums.setdefault(self._labels(tenant), [0.0, 0.0, 0.0])
            row[0] += self._usage.of("occupancy", tenant)
            row[1] += self._usage.of("prefill", tenant)
            row[2] += self._usage.of("decode", tenant)
        for label, (d, p, t) in sorted(sums.items()):
            decode.add_metric([label], d)
            prefill.add_metric([label], p)
            taken.add_metric([label], t)
        yield decode
        yield prefill
        yield taken
        queued = GaugeMetricFamily(
            "pdgate_pool_queued_requests",
            "Requests waiting for room in a pool (its engines at their admission limits)",
            labels=["pool"],
        )
        counts = {"prefill": 0, "decode": 0}
        for pool, n in self._queues():
            counts[pool] = counts.get(pool, 0) + n
        for pool, n in counts.items():
            queued.add_metric([pool], n)
        yield queued
