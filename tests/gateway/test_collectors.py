"""The scrape-time collectors: each scrape reads the part's state as it is now."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from gateway.ops import collectors
from gateway.tokenization import fasttok


def _scrape(collector: Any) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_bus_drops_are_read_at_each_scrape() -> None:
    bus = SimpleNamespace(dropped={"forged": 0, "replayed": 0})
    collector = collectors.BusCollector(cast(Any, bus))
    assert 'pdgate_worker_bus_dropped_messages_total{reason="forged"} 0.0' in _scrape(collector)
    bus.dropped["forged"] = 3  # no event reaches the collector: the next scrape sees the new count
    assert 'pdgate_worker_bus_dropped_messages_total{reason="forged"} 3.0' in _scrape(collector)


def test_fast_tokenizer_mismatches_are_counted_per_model() -> None:
    fasttok.count_mismatch("collector-test-model")
    text = _scrape(collectors.FastTokenizerCollector())
    assert 'pdgate_tokenizer_fastpath_mismatches_total{model="collector-test-model"}' in text


def test_tenants_are_summed_under_their_label() -> None:
    use = {("occupancy", "a"): 10.0, ("occupancy", "b"): 5.0, ("prefill", "a"): 100.0}
    usage = SimpleNamespace(tenants=lambda: ["a", "b"], of=lambda kind, t: use.get((kind, t), 0.0))
    collector = collectors.TenantCollector(cast(Any, usage), labels=lambda t: "all", queues=lambda: [])
    text = _scrape(collector)
    assert 'pdgate_tenant_decode_occupancy{tenant="all"} 15.0' in text  # a and b share one label
    assert 'pdgate_tenant_prefill_use{tenant="all"} 100.0' in text
