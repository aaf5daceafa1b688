"""The picker's own Prometheus series, read at scrape time: requests held for Envoy's report, the
access log entries and what became of them, and the endings passed between pickers. Everything
else (decisions, requests, failovers, admission) is the gateway's own metrics, as under ``serve``."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.epp.completions import Completions
from gateway.epp.sharing import SharedEndings


class PickerCollector:
    def __init__(self, completions: Completions, sharing: SharedEndings | None) -> None:
        self._completions = completions
        self._sharing = sharing

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self._completions
        yield GaugeMetricFamily(
            "pdgate_epp_held_requests",
            "Requests routed by the picker and not yet ended by Envoy's access log (their slots stay taken)",
            value=len(c),
        )
        entries = CounterMetricFamily(
            "pdgate_epp_access_log_entries",
            "Envoy's access log entries: ended a held request, or held here by none (refused, another picker's)",
            labels=["result"],
        )
        entries.add_metric(["ended"], c.reported)
        entries.add_metric(["unmatched"], c.unmatched)
        yield entries
        yield CounterMetricFamily(
            "pdgate_epp_unconfirmed_requests",
            "Held requests released without an access log entry (epp.completion_timeout_s, the bound on held ones)",
            value=c.unconfirmed,
        )
        if self._sharing is not None:
            s = self._sharing
            shared = CounterMetricFamily(
                "pdgate_epp_shared_endings",
                "Endings passed between pickers over Redis: published here, applied here, dropped (queue full)",
                labels=["event"],
            )
            for event, n in (("published", s.published), ("applied", s.applied), ("dropped", s.dropped)):
                shared.add_metric([event], n)
            yield shared
            yield CounterMetricFamily(
                "pdgate_epp_shared_errors", "Failed Redis publishes or subscriptions of the endings", value=s.errors
            )
