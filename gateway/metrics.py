"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from policies.prefix_index import PrefixStore

from .kvevents import KVEventSubscriber
from .pools import Pools
from .state import RedisState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pools: Pools, index: PrefixStore | None = None,
                 feeds: Callable[[], Sequence[KVEventSubscriber]] = list, shared: RedisState | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pools = pools
        self.registry.register(_RoutingStateCollector(pools, index, feeds, shared))
        self._request_children: dict[tuple[str, str, int], Counter] = {}
        self._duration_children: dict[str, Histogram] = {}
        self.requests = Counter(
            "pdgate_requests", "Client requests by model, path taken and HTTP status",
            ["model", "path", "status"], registry=self.registry,
        )
        self.duration = Histogram(
            "pdgate_request_duration_seconds", "Time from request to the last byte sent to the client",
            ["path"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.decisions = Counter(
            "pdgate_route_decisions", "Routing decisions by path and reason",
            ["path", "reason"], registry=self.registry,
        )
        self.healthy = Gauge(
            "pdgate_endpoint_healthy", "1 when the endpoint passes health checks",
            ["pool", "endpoint"], registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdgate_endpoint_in_flight_requests", "Requests the gateway has open on the endpoint",
            ["pool", "endpoint"], registry=self.registry,
        )

        self.failovers = Counter(
            "pdgate_failovers", "Failovers by event (prefill_retried, prefill_fallback_direct, decode_retried)",
            ["event"], registry=self.registry,
        )
        self.reloads = Counter(
            "pdgate_config_reloads", "Config file reloads by result (ok, rejected)",
            ["result"], registry=self.registry,
        )
        self.config_info = Gauge(
            "pdgate_config_info", "1 for the version of the config in use", ["version"], registry=self.registry,
        )

    def finished(self, model: str, path: str, status: int, seconds: float) -> None:
        """One request over. The labelled children are looked up once per label set: prometheus
        client's labels() costs microseconds a call, on every request."""
        key = (model, path, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(model, path, str(status))
        hist = self._duration_children.get(path)
        if hist is None:
            hist = self._duration_children[path] = self.duration.labels(path)
        counter.inc()
        hist.observe(seconds)

    def config_loaded(self, version: str) -> None:
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def render(self) -> bytes:
        for ep in self._pools.all():
            self.healthy.labels(ep.pool, ep.url).set(1 if ep.healthy else 0)
            self.in_flight.labels(ep.pool, ep.url).set(ep.in_flight)
        return generate_latest(self.registry)


class _RoutingStateCollector:
    """Routing state read at scrape time: the prefix index, the KV event feeds, engine signals."""

    def __init__(self, pools: Pools, index: PrefixStore | None,
                 feeds: Callable[[], Sequence[KVEventSubscriber]], shared: RedisState | None) -> None:
        self._pools, self._index, self._feeds, self._shared = pools, index, feeds, shared

    def describe(self) -> list:
        return []  # collected at scrape time only; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        backlog = GaugeMetricFamily(
            "pdgate_endpoint_backlog_tokens",
            "Uncached prompt tokens the gateway sent to the endpoint whose prefill has not finished",
            labels=["pool", "endpoint"])
        speed = GaugeMetricFamily(
            "pdgate_endpoint_prefill_seconds_per_token", "Prefill speed learned from observed prefill legs",
            labels=["pool", "endpoint"])
        for ep in self._pools.all():
            backlog.add_metric([ep.pool, ep.url], ep.backlog_tokens)
            if ep.prefill_s_per_token is not None:
                speed.add_metric([ep.pool, ep.url], ep.prefill_s_per_token)
        yield backlog
        yield speed
        if self._index is not None:
            st = self._index.stats()
            blocks = GaugeMetricFamily("pdgate_prefix_index_blocks",
                                       "(endpoint, block) entries in the prefix index by source", labels=["source"])
            blocks.add_metric(["learned"], st.approximate)
            blocks.add_metric(["kv_events"], st.precise)
            yield blocks
        connected = GaugeMetricFamily("pdgate_kv_events_connected",
                                      "1 while the endpoint's KV event feed is connected", labels=["endpoint"])
        events = CounterMetricFamily("pdgate_kv_events", "KV cache events applied to the prefix index",
                                     labels=["endpoint"])
        gaps = CounterMetricFamily("pdgate_kv_events_gaps", "Sequence gaps seen on a KV event feed",
                                   labels=["endpoint"])
        for feed in self._feeds():
            c = feed.counters
            connected.add_metric([feed.url], 1 if c.connected else 0)
            events.add_metric([feed.url], c.events_applied)
            gaps.add_metric([feed.url], c.gaps)
        yield connected
        yield events
        yield gaps
        if self._shared is not None:
            up = GaugeMetricFamily("pdgate_shared_state_up",
                                   "1 while the shared state backend (Redis) answers; 0: routing on local state",
                                   labels=["backend"])
            up.add_metric(["redis"], 1 if self._shared.status.healthy else 0)
            yield up
            errors = CounterMetricFamily("pdgate_shared_state_errors", "Failed or timed-out Redis operations")
            errors.add_metric([], self._shared.errors)
            yield errors
            dropped = CounterMetricFamily("pdgate_shared_state_dropped_writes",
                                          "Learned-prefix writes dropped because Redis could not keep up")
            dropped.add_metric([], self._shared.dropped_writes)
            yield dropped
