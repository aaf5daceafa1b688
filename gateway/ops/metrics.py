"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gateway.cluster.redis_state import RedisState
from gateway.engines.kvevents import KVEventSubscriber
from gateway.engines.pools import Pools
from gateway.fairness.tenants import Usage
from gateway.http.auth import authorize_admin
from gateway.http.errors import APIError
from gateway.ops import collectors
from gateway.ops.histogram import Tally, TallyHistogram
from gateway.ops.requestlog import RequestRecord
from policies.base import LegReport, RequestContext
from policies.beliefs.prefix_index import PrefixStore
from policies.beliefs.tier_audit import TierCounterCheck
from policies.beliefs.tiers import TIERS, TIERS_NAMES, hold_of

if TYPE_CHECKING:
    from starlette.requests import Request

    from gateway.adapters.loader import AdapterLoader
    from gateway.cluster.workerbus import WorkerBus
    from gateway.engines.discovery import SliceWatcher
    from gateway.engines.modelcheck import ServedModels
    from gateway.fairness.admission import Gate, LoopLag
    from gateway.http.connections import Connections

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
        self.registry.register(collectors.RoutingStateCollector(pools, index, feeds, shared, prefill_speed))
        self.registry.register(collectors.DiscoveryCollector(watchers))
        self.registry.register(collectors.PoolCollector(pools))
        self.registry.register(collectors.FastTokenizerCollector())
        GCCollector(registry=self.registry)  # python_gc_*: collections by generation (gateway/ops/gcpolicy.py)
        ProcessCollector(registry=self.registry)  # process_*: CPU seconds, resident memory, open fds
        if models is not None:
            self.registry.register(collectors.ModelsCollector(models, pools))
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
        # observed per relayed chunk: counted per stream and added in batches (gateway/ops/histogram.py)
        self.itl = TallyHistogram(
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
        # With routing.tiers on: prompt tokens believed held per tier, and how many the engines'
        # answers confirmed (their cached_tokens, attributed GPU first, then L1, then L2).
        self.tier_believed = Counter(
            "pdgate_tier_believed_tokens",
            "Prompt tokens routing believed an engine held, by KV tier (gpu, l1: its CPU tier, l2: the "
            "shared store), on legs whose engine reported its cache hits",
            ["tier"],
            registry=r,
        )
        self.tier_confirmed = Counter(
            "pdgate_tier_confirmed_tokens",
            "Of those, the tokens the engine's reported cache hits confirm (attributed gpu, then l1, then l2)",
            ["tier"],
            registry=r,
        )
        self.tier_error = Histogram(
            "pdgate_tier_belief_error_tokens",
            "Tokens believed in a tier that the engine's answer did not confirm",
            ["tier"],
            buckets=_BELIEF_BUCKETS,
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
        if rec.itl is not None:  # the stream's last gaps
            rec.itl.flush()
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

    def itl_for(self, model: str, path: str) -> Tally:
        """A stream's own inter-token tally, added to the histogram in batches and at its end
        (``record``)."""
        return self.itl.tally(model, path)

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
        self.registry.register(collectors.TenantCollector(usage, labels, queues))

    def watch_tier_counters(self, check: TierCounterCheck, pools: Pools) -> None:
        """Export the engines' counters against the tier beliefs (policies/beliefs/tier_audit.py)."""
        self.registry.register(collectors.TierCounterCollector(check, pools))

    def watch_adapter_loads(self, loader: AdapterLoader) -> None:
        """Export the LoRA adapter loads and unloads (gateway/adapters/loader.py)."""
        self.registry.register(collectors.AdapterLoadCollector(loader))

    def watch_bus(self, bus: WorkerBus) -> None:
        """Export what the workers' hub dropped (gateway/cluster/workerbus.py), read at scrape time."""
        self.registry.register(collectors.BusCollector(bus))

    def decided(self, path: str, reason: str) -> None:
        self._child(self.decisions, path, reason).inc()

    def watch_admission(self, gate: Gate, connections: Connections | None, lag: LoopLag | None = None) -> None:
        """Export the admission slots, the event loop's lag and the HTTP server's connections (read
        at scrape time)."""
        self.registry.register(collectors.AdmissionCollector(gate, connections, lag))

    def rejected(self, reason: str) -> None:
        self._child(self.rejections, reason).inc()

    def watch_planner(self, exported: Callable[[], dict[str, Any] | None]) -> None:
        """Export the live planner's recommendation (gateway/ops/live_planner.py), read at scrape time."""
        self.registry.register(collectors.PlannerCollector(exported))

    def hook_failed(self, subscriber: str, hook: str) -> None:
        self.hook_errors.labels(subscriber, hook).inc()

    def restarted(self, pool: str) -> None:
        self.restarts.labels(pool).inc()

    def config_loaded(self, version: str) -> None:
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
        hold = hold_of(ctx, leg.url)
        error = hold.held - leg.cached_tokens
        m = self._metrics
        if ctx.data.get(TIERS) is not None:
            left = leg.cached_tokens  # what the engine served, attributed in the order it loads
            for tier in TIERS_NAMES:
                believed = getattr(hold, tier)
                confirmed = min(believed, max(left, 0))
                left -= believed
                m._child(m.tier_believed, tier).inc(believed)
                m._child(m.tier_confirmed, tier).inc(confirmed)
                if believed > confirmed:
                    m._child(m.tier_error, tier).observe(believed - confirmed)
        result = "exact" if error == 0 else "over" if error > 0 else "under"
        m._child(m.belief_checks, leg.leg, result).inc()
        if error:
            m._child(m.belief_error, leg.leg, result).observe(abs(error))
