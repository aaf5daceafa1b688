"""A Prometheus histogram that streams add to in tallies: the inter-token latency's.

``prometheus_client``'s ``Histogram.observe`` takes two locks and walks the buckets in Python, about
a microsecond per call even on a warm cache; the inter-token histogram was observed once per relayed
chunk, the relay's one metric on its per-chunk path (docs/benchmarks.md, "Stream relay"). Here a
stream counts its gaps into a ``Tally`` of its own (a bisect in C and two additions, no lock: one
event loop writes it), which joins the shared counts every ``FLUSH_EVERY`` gaps and when the stream
ends. A scrape therefore sees a stream's gaps up to ``FLUSH_EVERY`` chunks late.

The exposition is ``prometheus_client``'s own (a ``HistogramMetricFamily`` from a registered
collector, ``_created`` as the library writes it); tests/gateway/test_histogram.py feeds the same
values to this and to a ``prometheus_client.Histogram`` and compares the two expositions.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# The library's own ``le`` formatting; it has no type hints, so it is given one here.
_go_float: Callable[[float], str] = floatToGoString

FLUSH_EVERY = 64  # gaps a tally holds before they join the shared counts


def _created_series() -> bool:
    """Whether ``_created`` samples are written: prometheus_client's documented switch."""
    return os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")


class Counts:
    """One label set's bucket counts (not cumulative) and sum."""

    __slots__ = ("buckets", "created", "sum")

    def __init__(self, size: int) -> None:
        self.buckets = [0] * size
        self.sum = 0.0
        self.created = time.time()

    def add(self, buckets: Sequence[int], total: float) -> None:
        mine = self.buckets
        for i, n in enumerate(buckets):
            if n:
                mine[i] += n
        self.sum += total


class Tally:
    """One stream's gaps, counted here and added to its label set's ``Counts`` in batches."""

    __slots__ = ("_bounds", "_buckets", "_into", "_n", "_sum")

    def __init__(self, bounds: tuple[float, ...], into: Counts) -> None:
        self._bounds = bounds
        self._into = into
        self._buckets = [0] * len(bounds)
        self._sum = 0.0
        self._n = 0

    def observe(self, value: float) -> None:
        """One finite value (a bucket's bound counts in that bucket, as prometheus_client counts it)."""
        self._buckets[bisect_left(self._bounds, value)] += 1
        self._sum += value
        self._n += 1
        if self._n >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """What is counted here joins the shared counts (the stream's end calls it)."""
        if self._n:
            self._into.add(self._buckets, self._sum)
            self._buckets = [0] * len(self._bounds)
            self._sum = 0.0
            self._n = 0


class TallyHistogram(Collector):
    """A histogram with labels whose observations come in ``Tally`` batches."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("buckets must be in increasing order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._name, self._doc, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = tuple(bounds)
        self._les = tuple(_go_float(b) for b in bounds)
        self._children: dict[tuple[str, ...], Counts] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> Counts:
        """The label set's counts (shown from now on, as ``Histogram.labels`` makes a child)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected")
        counts = self._children.get(values)
        if counts is None:
            counts = self._children[values] = Counts(len(self._bounds))
        return counts

    def tally(self, *values: str) -> Tally:
        """A new tally for one stream, adding to this label set."""
        return Tally(self._bounds, self.labels(*values))

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        created = _created_series()
        for values, counts in list(self._children.items()):
            running, cumulative = 0, []
            for le, n in zip(self._les, counts.buckets, strict=True):
                running += n
                cumulative.append((le, running))
            family.add_metric(list(values), cumulative, counts.sum)
            if created:
                labels = dict(zip(self._labelnames, values, strict=True))
                family.samples.append(Sample(self._name + "_created", labels, counts.created))
        yield family
