"""gateway/ops/histogram.py against its reference, prometheus_client's Histogram: the same values
make the same exposition (buckets, count, sum, labels, help, type), and a stream's values reach a
scrape in batches and at its end."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.ops.histogram import FLUSH_EVERY, TallyHistogram
from gateway.ops.metrics import _ITL_BUCKETS

NAME, HELP = "pdgate_inter_token_latency_seconds", "Streams: time between consecutive chunks sent to the client"


def _pair(buckets=_ITL_BUCKETS) -> tuple[CollectorRegistry, Histogram, CollectorRegistry, TallyHistogram]:
    ref_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram(NAME, HELP, ["model", "path"], buckets=buckets, registry=ref_registry)
    ours = TallyHistogram(NAME, HELP, ["model", "path"], buckets=buckets, registry=ours_registry)
    return ref_registry, ref, ours_registry, ours


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name == NAME + "_created":  # a gauge family of its own, in the text format
            continue
        assert (family.name, family.documentation, family.type) == (NAME, HELP, "histogram")
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _text_without_created(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_same_values_make_the_same_exposition_as_prometheus_client(seed: int) -> None:
    rnd = random.Random(seed)
    ref_registry, ref, ours_registry, ours = _pair()
    streams = [("m", "direct"), ("m", "pd"), ("other", "direct")]
    for _ in range(40):  # streams of various lengths; bounds themselves, zero, and past the last bound
        labels = rnd.choice(streams)
        tally = ours.tally(*labels)
        for _ in range(rnd.randint(0, 3 * FLUSH_EVERY)):
            value = rnd.choice([rnd.random() * 0.3, rnd.choice(_ITL_BUCKETS), 0.0, 3.0 + rnd.random()])
            ref.labels(*labels).observe(value)
            tally.observe(value)
        tally.flush()
    want, got = _samples(ref_registry), _samples(ours_registry)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key  # sums add in another order


def test_counts_and_bucket_lines_are_identical_text() -> None:
    ref_registry, ref, ours_registry, ours = _pair()
    tally = ours.tally("m", "direct")
    for value in (0.001, 0.0011, 0.02, 0.5, 2.5, 9.0, 0.0):  # exact sums: no rounding to differ
        ref.labels("m", "direct").observe(value)
        tally.observe(value)
    tally.flush()
    ref_lines = [line for line in _text_without_created(ref_registry) if "_sum" not in line]
    our_lines = [line for line in _text_without_created(ours_registry) if "_sum" not in line]
    assert ref_lines == our_lines


def test_a_label_set_is_shown_from_its_first_tally_as_a_child_is_from_labels() -> None:
    ref_registry, ref, ours_registry, ours = _pair()
    ref.labels("m", "pd")
    ours.tally("m", "pd")
    assert _samples(ref_registry) == _samples(ours_registry)
    created = [s for f in ours_registry.collect() for s in f.samples if s.name.endswith("_created")]
    assert len(created) == 1 and created[0].labels == {"model": "m", "path": "pd"}


def test_a_streams_values_reach_a_scrape_every_flush_every_values_and_at_its_end() -> None:
    _, _, registry, ours = _pair()

    def count() -> float:
        return registry.get_sample_value(NAME + "_count", {"model": "m", "path": "direct"}) or 0.0

    tally = ours.tally("m", "direct")
    for _ in range(FLUSH_EVERY - 1):
        tally.observe(0.02)
    assert count() == 0  # still the stream's own
    tally.observe(0.02)
    assert count() == FLUSH_EVERY
    tally.observe(0.02)
    tally.flush()
    tally.flush()  # twice: nothing counted twice
    assert count() == FLUSH_EVERY + 1

    def bucket(le: str) -> float | None:
        return registry.get_sample_value(NAME + "_bucket", {"model": "m", "path": "direct", "le": le})

    assert bucket("0.02") == FLUSH_EVERY + 1 and bucket("0.015") == 0


def test_bad_definitions_and_label_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        TallyHistogram("x", "x", ["a"], buckets=[1.0, 0.5])
    h = TallyHistogram("x", "x", ["a"], buckets=[1.0, math.inf])
    with pytest.raises(ValueError, match="label values"):
        h.tally("a", "b")
    assert h.tally("a") is not None
