"""The gateway's own Prometheus metrics, in a registry owned by the app (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from .pools import Pools

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pools: Pools) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pools = pools
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

        self.reloads = Counter(
            "pdgate_config_reloads", "Config file reloads by result (ok, rejected)",
            ["result"], registry=self.registry,
        )
        self.config_info = Gauge(
            "pdgate_config_info", "1 for the version of the config in use", ["version"], registry=self.registry,
        )

    def config_loaded(self, version: str) -> None:
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def render(self) -> bytes:
        for ep in self._pools.all():
            self.healthy.labels(ep.pool, ep.url).set(1 if ep.healthy else 0)
            self.in_flight.labels(ep.pool, ep.url).set(ep.in_flight)
        return generate_latest(self.registry)
