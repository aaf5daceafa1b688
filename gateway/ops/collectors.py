"""Collectors: metrics read from the gateway's parts at scrape time, not counted as things happen.

Each collector holds a reference to the part it reads (pools, discovery watchers, the routing
state, served models, the planner, admission, the worker bus, tenants, the fast tokenizer) and
builds its families fresh on every scrape, so a gauge can never go stale between events.
``metrics.GatewayMetrics`` registers them in its own registry; names match the docs' metric
reference and, where the engine has one, the engine's name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.tokenization import fasttok

if TYPE_CHECKING:
    from gateway.adapters.loader import AdapterLoader
    from gateway.cluster.redis_state import RedisState
    from gateway.cluster.workerbus import WorkerBus
    from gateway.engines.discovery import SliceWatcher
    from gateway.engines.kvevents import KVEventSubscriber
    from gateway.engines.modelcheck import ServedModels
    from gateway.engines.pools import Pools
    from gateway.fairness.admission import Gate, LoopLag
    from gateway.fairness.tenants import Usage
    from gateway.http.connections import Connections
    from policies.beliefs.prefix_index import PrefixStore
    from policies.beliefs.tier_audit import TierCounterCheck


class PoolCollector:
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


class DiscoveryCollector:
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


class RoutingStateCollector:
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


class ModelsCollector:
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


class PlannerCollector:
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


class AdmissionCollector:
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
            stalled = CounterMetricFamily(
                "pdgate_http_connections_stalled",
                "Client connections reset because the client took none of the bytes waiting for it for "
                "server.client_stall_timeout_s (their engine requests aborted)",
            )
            stalled.add_metric([], self._connections.stalled)
            yield from (open_, refused, stalled)


class BusCollector:
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


class FastTokenizerCollector:
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


class TenantCollector:
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


class TierCounterCollector:
    """Per engine, its own cache-hit counters over what routing believed it would serve from each
    tier (``policies/beliefs/tier_audit.py``), and whether its tiers are distrusted."""

    def __init__(self, check: TierCounterCheck, pools: Pools) -> None:
        self._check, self._pools = check, pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ratio = GaugeMetricFamily(
            "pdgate_tier_counter_ratio",
            "Prompt tokens the engine's vllm:prompt_tokens_cached_by_source counted from the tier "
            "(gpu: device; below: host, disk, external_unspecified) over those routing believed it "
            "held there, the last closed window (under 1: routing believed more than was served)",
            labels=["pool", "engine", "tier"],
        )
        distrusted = GaugeMetricFamily(
            "pdgate_tier_distrusted",
            "1 while the engine's counters say it does not load what it was believed to hold below "
            "the GPU (its L1 and L2 beliefs do not count)",
            labels=["pool", "engine"],
        )
        pools = {e.url: e.pool for e in self._pools.all()}
        for url, state in self._check.state().items():
            if (pool := pools.get(url)) is None:
                continue
            for tier, value in state.ratio.items():
                ratio.add_metric([pool, url, tier], value)
            distrusted.add_metric([pool, url], 1.0 if state.distrusted else 0.0)
        yield ratio
        yield distrusted


class AdapterLoadCollector:
    """LoRA adapters this gateway loaded on (and unloaded from) the engines, by result."""

    def __init__(self, loader: AdapterLoader) -> None:
        self._loader = loader

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily(
            "pdgate_adapter_loads",
            "LoRA adapter loads the gateway asked engines for (lora.dynamic_loading), by result",
            labels=["result"],
        )
        for result in ("ok", "failed", "timeout"):
            loads.add_metric([result], self._loader.loads[result])
        unloads = CounterMetricFamily(
            "pdgate_adapter_unloads",
            "LoRA adapters the gateway unloaded for room (lora.max_adapters_per_engine), by result",
            labels=["result"],
        )
        for result in ("ok", "failed"):
            unloads.add_metric([result], self._loader.unloads[result])
        yield loads
        yield unloads
