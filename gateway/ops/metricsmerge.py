"""One ``/metrics`` for a gateway of several worker processes: the workers' expositions merged.

Each worker keeps its metrics in its own registry (no cost on the request path: prometheus-client's
multiprocess mode writes every observation to a memory-mapped file and cannot merge collectors
computed at scrape time). At scrape time the serving worker gathers the others' text
(gateway/cluster/workerbus.py) and merges it here, parsed with prometheus-client's own parser. How a
family merges follows what it counts:

- counts of this worker's own work (requests, latencies, in-flight, connections, memory): **sum**;
- what every worker observes alike (engine health and signals, discovery, KV event feeds, config
  reloads, restarts seen, the prefix index every worker keeps whole): **max**, so an event seen by
  every worker counts once; and the event loop's lag: the worst worker's;
- "all is well" flags and start times (``pdgate_kv_events_connected``, ``pdgate_shared_state_up``,
  ``process_start_time_seconds``, ``*_created``): **min**, so one worker's broken feed shows; and
  how far each worker's tier beliefs were confirmed (``pdgate_tier_counter_ratio``): the worst's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

Rule = Literal["sum", "max", "min"]

_SAME_IN_EVERY_WORKER = frozenset(
    {
        "pdgate_pool_healthy_endpoints",
        "pdgate_pool_engine_waiting_requests",
        "pdgate_pool_engine_running_requests",
        "pdgate_pool_kv_usage_ratio",
        "pdgate_pool_reporting_endpoints",
        "pdgate_endpoint_healthy",
        "pdgate_endpoint_prefill_seconds_per_token",
        "pdgate_endpoint_model_missing",
        "pdgate_prefix_index_blocks",
        "pdgate_discovery_synced",
        "pdgate_discovery_endpoints",
        "pdgate_discovery_lists",
        "pdgate_discovery_errors",
        "pdgate_kv_events",
        "pdgate_kv_events_gaps",
        "pdgate_kv_events_invalid",
        "pdgate_kv_events_disconnects",
        "pdgate_config_reloads",
        "pdgate_config_info",
        "pdgate_endpoint_restarts",
        "pdgate_tier_distrusted",
        "pdgate_event_loop_lag_seconds",
        "pdgate_event_loop_lag_max_seconds",
        "pdgate_planner_compute_seconds",
        "pdgate_planner_unmet",
        # every worker's figure already adds the other workers' and replicas' (shared tenant use)
        "pdgate_tenant_decode_occupancy",
        "pdgate_tenant_prefill_use",
        "pdgate_tenant_decode_use",
        "python_info",
        "process_max_fds",
    }
)
_ALL_MUST_HOLD = frozenset(
    {
        "pdgate_kv_events_connected",
        "pdgate_shared_state_up",
        "process_start_time_seconds",
        "pdgate_tier_counter_ratio",
    }
)
# Gauges of each worker's own share (counters and histograms are always summed).
SUMMED_GAUGES = frozenset(
    {
        "pdgate_pool_in_flight_requests",
        "pdgate_pool_uncached_prompt_tokens",
        "pdgate_endpoint_in_flight_requests",
        "pdgate_endpoint_backlog_tokens",
        "pdgate_admission_in_flight",
        "pdgate_admission_queued",
        "pdgate_http_connections",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "pdgate_pool_desired_engines",
        "pdgate_planner_window_requests",
        "pdgate_planner_unservable_requests",
        "pdgate_pool_queued_requests",
    }
)
DECLARED = _SAME_IN_EVERY_WORKER | _ALL_MUST_HOLD | SUMMED_GAUGES  # a new gauge must be placed in one (tested)


def rule_for(family: str) -> Rule:
    if family in _SAME_IN_EVERY_WORKER:
        return "max"
    if family in _ALL_MUST_HOLD:
        return "min"
    return "sum"


def merge(texts: Iterable[bytes], stale: Iterable[bytes] = ()) -> bytes:
    """The expositions in ``texts`` (Prometheus text format) as one. ``stale``: the last answers of
    workers that did not answer this scrape (dead, restarting, stuck). Their counters and histograms
    count (leaving them out would make a sum go down, which Prometheus reads as a reset); their
    gauges do not: a dead worker's in-flight requests are not in flight any more."""
    families: dict[str, Metric] = {}
    merged: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    given = [(text, False) for text in texts] + [(text, True) for text in stale]
    for text, old_answer in given:
        for fam in text_string_to_metric_families(text.decode("utf-8", "replace")):
            if old_answer and fam.type in ("gauge", "info", "stateset", "unknown"):
                continue
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                merged[fam.name] = {}
            values = merged[fam.name]
            rule = rule_for(fam.name)
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                how = "min" if s.name.endswith("_created") else rule
                old = values.get(key)
                if old is None:
                    values[key] = s.value
                elif how == "sum":
                    values[key] = old + s.value
                elif how == "max":
                    values[key] = max(old, s.value)
                else:
                    values[key] = min(old, s.value)
    for name, fam in families.items():
        for (sample, labels), value in merged[name].items():
            fam.add_sample(sample, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
