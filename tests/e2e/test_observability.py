"""End to end: a real gateway process exports its traces over OTLP/HTTP to a collector, propagates
them to the engines, writes JSON access lines, and exports every metric the Grafana dashboard uses."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.otlp import Collector
from tests.procs import ProcGroup, free_port, wait_for
from tests.promtext import sample

from .cluster import Cluster
from .test_shared_state import start_redis

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
THRESHOLD = 200
LONG = "Summarize the incident log: " + "the decode pool kept streaming while prefill ran elsewhere. " * 40
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdgate-dashboard.json"
# Labels Prometheus (and its Operator, for a ServiceMonitor) attach to every scraped series. The
# dashboard may filter on them; the gateway must never export them, or they would be renamed
# exported_<name> (the Operator sets `endpoint` to the scrape port's name).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
SELECTOR_LABELS = {"namespace", "job"}  # of those, the ones the dashboard selects on


@pytest.fixture(scope="module")
def setup(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    collector = Collector()
    c = Cluster(group, tokenizer_dir)
    try:
        redis_port = free_port()
        start_redis(group, redis_port)
        c.prefill.append(c.start_sim("prefill", "--prefill-time-per-token", "0.0002"))
        pub = free_port()
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}"})
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.005", "--kv-events-config", events))
        c.start_gateway(
            THRESHOLD,
            pools={
                "prefill": {"endpoints": [c.prefill[0].url]},
                "decode": {"endpoints": [{"url": c.decode[0].url, "kv_events": f"tcp://127.0.0.1:{pub}"}]},
            },
            env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export spans every 0.1 s, not 5 s
            state={"backend": "redis", "url": f"redis://127.0.0.1:{redis_port}/0", "key_prefix": "obs-e2e"},
            telemetry={"tracing": {"exporter": "otlp", "endpoint": collector.url}},
            signals={"scrape_interval_s": 0.2, "scrape_timeout_s": 2.0, "max_age_s": 5.0},
        )
        yield c, collector
    finally:
        group.stop_all()
        collector.stop()


def stream_chat(c: Cluster, content: str, request_id: str) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", c.url + "/v1/chat/completions", json=body, timeout=60, headers={"x-request-id": request_id}
    ) as r:
        r.read()
    assert r.status_code == 200, r.text
    return r


def test_a_pd_stream_is_one_trace_from_gateway_to_both_engines(setup):
    c, collector = setup
    r = stream_chat(c, "One. " + LONG, "obs-pd-1")
    assert r.headers["x-pdgate-path"] == "pd"
    sent = {
        s.url: [q for q in s.requests() if q["headers"].get("x-request-id") == "obs-pd-1"]
        for s in (*c.prefill, *c.decode)
    }
    [pre_leg] = sent[c.prefill[0].url]
    [dec_leg] = sent[c.decode[0].url]
    trace_id = pre_leg["headers"]["traceparent"].split("-")[1]
    assert dec_leg["headers"]["traceparent"].split("-")[1] == trace_id
    assert wait_for(lambda: len(collector.trace(trace_id)) >= 5, timeout=15), collector.spans
    spans = {s.name: s for s in collector.trace(trace_id)}
    server = spans["POST /v1/chat/completions"]
    for name in ("tokenize", "route", "prefill", "decode"):
        assert spans[name].parent_span_id == server.span_id, name
    # The engines got their own leg's span as parent: their spans nest under the right leg.
    assert pre_leg["headers"]["traceparent"].split("-")[2] == spans["prefill"].span_id.hex()
    assert dec_leg["headers"]["traceparent"].split("-")[2] == spans["decode"].span_id.hex()
    route = {a.key: a.value for a in spans["route"].attributes}
    assert route["pdgate.path"].string_value == "pd" and route["pdgate.reason"].string_value == "long_uncached"


def test_each_request_writes_one_json_access_line(setup):
    c, _ = setup
    stream_chat(c, "hello there", "obs-direct-1")

    def line():
        for raw in c.gateway.log_path.read_text(errors="replace").splitlines():
            if raw.startswith("{") and '"obs-direct-1"' in raw:
                return json.loads(raw)
        return None

    assert wait_for(lambda: line() is not None, timeout=10), c.gateway.log_tail()
    entry = line()
    assert entry["path"] == "direct" and entry["status"] == 200 and entry["stream"] is True
    assert entry["output_tokens"] == 12  # from the usage chunk
    assert entry["decode"] == c.decode[0].url and entry["prefill"] is None
    assert 0 < entry["ttft_ms"] <= entry["total_ms"] and entry["trace_id"]


def test_stream_latencies_and_pool_signals_are_exported(setup):
    c, _ = setup
    before = httpx.get(c.url + "/metrics").text
    stream_chat(c, "Two. " + LONG, "obs-pd-2")
    after = httpx.get(c.url + "/metrics").text

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    pd = {"model": "tiny", "path": "pd"}
    assert delta("pdgate_time_to_first_token_seconds_count", **pd) == 1
    assert delta("pdgate_inter_token_latency_seconds_count", **pd) >= 10  # ~one per token
    assert delta("pdgate_output_tokens_total", **pd) == 12
    assert delta("pdgate_prefill_leg_duration_seconds_count", model="tiny", outcome="ok") == 1
    assert sample(after, "pdgate_pool_healthy_endpoints", pool="decode") == 1
    assert wait_for(
        lambda: sample(httpx.get(c.url + "/metrics").text, "pdgate_pool_reporting_endpoints", pool="decode") == 1,
        timeout=10,
    )


def dashboard_panels() -> list[dict]:
    """Every panel, those inside (collapsed) rows too."""
    out, todo = [], list(json.loads(DASHBOARD.read_text())["panels"])
    while todo:
        panel = todo.pop(0)
        out.append(panel)
        todo.extend(panel.get("panels", []))
    return out


def dashboard_queries() -> list[str]:
    exprs = [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    exprs += [v["query"]["query"] for v in variables if isinstance(v.get("query"), dict)]
    return exprs


def test_every_dashboard_metric_and_label_is_exported(setup):
    c, _ = setup
    # A failed prefill leg that falls back to direct, then a clean P/D stream: every family has samples.
    httpx.put(c.prefill[0].url + "/sim/faults", json={"error": {"status": 500, "count": 1}}, timeout=5)
    r = stream_chat(c, "Three. " + LONG, "obs-pd-3")
    assert r.headers["x-pdgate-failover"] == "prefill_fallback_direct"
    stream_chat(c, "Four. " + LONG, "obs-pd-4")
    families = {}
    for fam in text_string_to_metric_families(httpx.get(c.url + "/metrics").text):
        labels = {k for s in fam.samples for k in s.labels} - {"le"}
        names = {s.name for s in fam.samples} | {fam.name}
        for n in names:
            families[n] = labels
    clashes = {m: sorted(labels & TARGET_LABELS) for m, labels in families.items() if labels & TARGET_LABELS}
    assert not clashes, f"these labels would be renamed exported_* by the scrape: {clashes}"
    exprs = dashboard_queries()
    assert len(exprs) > 20
    for expr in exprs:
        metrics = re.findall(r"\b(pdgate_[a-z0-9_]+)", expr)
        assert metrics, expr
        for m in metrics:
            assert m in families, f"the dashboard queries {m}, which the gateway does not export"
        used = set(re.findall(r"([a-z_]+)\s*(?:=~|!=|=)\s*\"", expr))
        for by in re.findall(r"by \(([^)]*)\)", expr):
            used |= {b.strip() for b in by.split(",")} - {"le"}
        known = set().union(*(families[m] for m in metrics)) | SELECTOR_LABELS
        assert used <= known, f"{expr}: labels {used - known} are not on {metrics}"
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            # Every series follows the namespace and job selectors (two releases, one Prometheus).
            for selector in re.findall(r"pdgate_[a-z0-9_]+\{([^}]*)\}", expr):
                assert 'namespace=~"$namespace"' in selector and 'job=~"$job"' in selector, expr
            assert not re.search(r"\bpdgate_[a-z0-9_]+\b(?!\{)", expr), f"a series without the selectors: {expr}"
            # A legend names labels the query's series really have.
            known = set().union(*(families[m] for m in re.findall(r"\b(pdgate_[a-z0-9_]+)", expr)))
            legend = set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", target.get("legendFormat", "")))
            assert legend <= known | SELECTOR_LABELS, f"{panel.get('title')}: legend labels {legend - known}"
