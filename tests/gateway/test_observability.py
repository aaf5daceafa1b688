"""Traces, metrics and access logs of the gateway's own request path, against scripted engines."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.testclient import TestClient

from gateway.config import ConfigError, TracingConfig, parse_config
from gateway.engines.pools import EngineStats, Pools
from gateway.http.app import create_app
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.requestlog import LineWriter, RequestRecord
from gateway.ops.tracing import Tracing
from tests.promtext import sample

from .scripted_engine import ScriptedEngine
from .test_component import KV, LONG, THRESHOLD, completion

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def chunk(text: str) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}


@pytest.fixture(scope="module")
def engines():
    found = [ScriptedEngine().start() for _ in range(3)]  # prefill, prefill, decode
    yield found
    for e in found:
        e.stop()


@pytest.fixture
def eng(engines):
    for e in engines:
        e.reset()
    return engines


@pytest.fixture(scope="module")
def exporter():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def access_lines() -> list[bytes]:
    return []


@pytest.fixture(scope="module")
def client(tokenizer_dir, engines, exporter, access_lines):
    cfg = parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
            "pools": {
                "prefill": {"endpoints": [engines[0].url, engines[1].url]},
                "decode": {"endpoints": [engines[2].url]},
            },
            "routing": {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}},
        }
    )
    with TestClient(create_app(cfg, span_exporter=exporter, access_sink=access_lines.append)) as c:
        yield c


@pytest.fixture
def spans(exporter):
    exporter.clear()
    return exporter


def tree(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    """The one server span, and its children by name."""
    finished = exporter.get_finished_spans()
    [server] = [s for s in finished if s.kind is SpanKind.SERVER]
    children: dict[str, list[ReadableSpan]] = {}
    for s in finished:
        if s is not server:
            assert s.context.trace_id == server.context.trace_id
            assert s.parent is not None and s.parent.span_id == server.context.span_id
            children.setdefault(s.name, []).append(s)
    return server, children


def traceparent_of(span: ReadableSpan) -> str:
    """version-trace-span, without the flags (sampled, maybe the random-trace-id bit)."""
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}"


def sent_parent(engine: ScriptedEngine) -> str:
    return engine.posts("/v1/completions")[0].headers["traceparent"].rsplit("-", 1)[0]


def script_pd(eng) -> None:
    for p in eng[:2]:  # whichever prefill engine the picker takes
        p.reply("/v1/completions", completion(kv=KV))
    eng[2].reply("/v1/completions", completion("decoded"))


def chosen_prefill(eng) -> ScriptedEngine:
    [used] = [p for p in eng[:2] if p.posts("/v1/completions")]
    return used


def test_pd_request_spans_tokenize_route_and_both_legs(client, eng, spans):
    script_pd(eng)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 8})
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "pd"
    prefill, decode = chosen_prefill(eng), eng[2]
    server, kids = tree(spans)
    assert sorted(kids) == ["decode", "prefill", "route", "tokenize"]
    assert server.name == "POST /v1/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["pdgate.request_id"] == r.headers["x-request-id"]
    route = kids["route"][0].attributes
    assert route["pdgate.path"] == "pd" and route["pdgate.reason"] == "long_uncached"
    assert route["pdgate.decode_endpoint"] == decode.url and route["pdgate.prefill_endpoint"] == prefill.url
    assert route["pdgate.prompt_tokens"] == int(r.headers["x-pdgate-prompt-tokens"])
    assert route["pdgate.uncached_tokens"] == route["pdgate.prompt_tokens"]  # nothing cached
    [pre], [dec] = kids["prefill"], kids["decode"]
    assert pre.kind is SpanKind.CLIENT and dec.kind is SpanKind.CLIENT
    assert pre.attributes["server.address"] == prefill.url and dec.attributes["server.address"] == decode.url
    assert pre.end_time <= dec.start_time  # the decode leg waits for the prefill's KV handle
    # Each engine joins the trace under its own leg's span (vLLM's --otlp-traces-endpoint).
    assert sent_parent(prefill) == traceparent_of(pre)
    assert sent_parent(decode) == traceparent_of(dec)


def test_the_clients_traceparent_is_joined(client, eng, spans):
    eng[2].reply("/v1/completions", completion("hi"))
    r = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "hello"},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"},
    )
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "direct"
    server, kids = tree(spans)
    assert f"{server.context.trace_id:032x}" == CLIENT_TRACE
    assert server.parent is not None and f"{server.parent.span_id:016x}" == CLIENT_PARENT
    assert "prefill" not in kids
    assert sent_parent(eng[2]) == traceparent_of(kids["decode"][0])
    assert sent_parent(eng[2]).split("-")[1] == CLIENT_TRACE


def test_a_retried_prefill_leg_is_an_event_with_its_cause(client, eng, spans):
    first, second, decode = eng
    before = client.get("/metrics").text
    for _ in range(4):  # ties between the prefill engines rotate: soon the failing one goes first
        for e in eng:
            e.reset()
        spans.clear()
        first.reply("/v1/completions", {"error": {"message": "boom"}}, status=500)
        second.reply("/v1/completions", completion(kv=KV))
        decode.reply("/v1/completions", completion("decoded"))
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": LONG})
        assert r.status_code == 200
        if "x-pdgate-failover" in r.headers:
            break
    assert r.headers["x-pdgate-failover"] == "prefill_retried"
    server, kids = tree(spans)
    [event] = server.events
    assert event.name == "prefill_retried" and event.attributes["pdgate.cause"] == "engine_error"
    failed, ok = sorted(kids["prefill"], key=lambda s: s.start_time)
    assert failed.status.status_code is StatusCode.ERROR and ok.status.status_code is not StatusCode.ERROR
    after = client.get("/metrics").text
    labels = {"event": "prefill_retried", "cause": "engine_error"}
    assert sample(after, "pdgate_failovers_total", **labels) == sample(before, "pdgate_failovers_total", **labels) + 1


def test_a_refused_request_still_ends_its_span(client, eng, spans):
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    server, kids = tree(spans)
    assert server.attributes["http.response.status_code"] == 404
    assert server.status.status_code is not StatusCode.ERROR  # the client's mistake, not ours
    assert kids == {}


def test_streams_count_ttft_itl_and_usage_tokens(client, eng):
    decode = eng[2]
    body = sse(
        chunk("a"),
        chunk("b"),
        chunk("c"),
        {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    )
    decode.reply("/v1/completions", raw=body)
    before = client.get("/metrics").text
    with client.stream(
        "POST",
        "/v1/completions",
        json={"model": "tiny", "prompt": "hello", "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        r.read()
    after = client.get("/metrics").text

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    direct = {"model": "tiny", "path": "direct"}
    assert delta("pdgate_output_tokens_total", **direct) == 3  # the usage chunk's count
    assert delta("pdgate_time_to_first_token_seconds_count", **direct) == 1
    assert delta("pdgate_decode_first_token_seconds_count", **direct) == 1
    assert delta("pdgate_requests_total", status="200", **direct) == 1
    assert delta("pdgate_request_duration_seconds_count", **direct) == 1
    assert delta("pdgate_prompt_tokens_total", **direct) > 0
    assert delta("pdgate_tokenize_duration_seconds_count", model="tiny") == 1
    assert delta("pdgate_route_decision_duration_seconds_count", model="tiny") == 1
    # The decode stream's uncached prompt tokens counted on the engine until its first token.
    assert sample(after, "pdgate_pool_uncached_prompt_tokens", pool="decode") == 0


def test_itl_counts_gaps_between_token_chunks_only():
    itl = []
    rec = RequestRecord("r", "completion")
    rec.itl = type("H", (), {"observe": staticmethod(itl.append)})()
    for text in ("a", "b", "c"):
        rec.sent_chunk(sse(chunk(text))[: -len(b"data: [DONE]\n\n")])
    rec.sent_chunk(b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n')
    rec.sent_chunk(b"data: [DONE]\n\n")
    rec.finish(200)
    assert len(itl) == 2 and all(g >= 0 for g in itl)  # a->b, b->c; not the usage chunk nor [DONE]
    assert rec.output_tokens == 3 and rec.ttft_s is not None


def test_token_events_are_counted_by_event_boundaries_however_the_reads_split():
    """Spliced pieces follow the engine's reads: a boundary split between two pieces still counts
    once, and a model writing "data: " in its text adds no event (without a usage chunk the
    count is the output token estimate)."""
    events = b"".join(sse(chunk(text))[: -len(b"data: [DONE]\n\n")] for text in ("a", "data: b", "c"))
    whole = events + b"data: [DONE]\n\n"
    for cut in range(1, len(whole)):
        rec = RequestRecord("r", "completion")
        rec.sent_chunk(whole[:cut])
        rec.sent_chunk(whole[cut:])
        assert rec.token_events == 3, cut
        rec.finish(200)
        assert rec.output_tokens == 3


@pytest.mark.parametrize(
    "count", [b"NaN", b"Infinity", b"-Infinity", b"1e999", pytest.param(b"9" * 5000, id="5000-digits")]
)
def test_a_usage_count_that_is_no_readable_integer_is_left_unset_and_the_stream_relayed(count):
    """The byte-for-byte relay never parses the engine's JSON: a count it cannot read (NaN, an
    exponent, more digits than int() takes) is not counted, and the stream still goes out whole."""
    from gateway.request.answer_relay import Outcome, _Relayed

    usage = b'"usage":{"prompt_tokens":2,"completion_tokens":%b,"prompt_tokens_details":{"cached_tokens":%b}}'
    usage %= (count, count)
    events = [
        sse(chunk("a"))[: -len(b"data: [DONE]\n\n")],
        b'data: {"id":"x","choices":[],' + usage + b"}\n\n",
        b"data: [DONE]\n\n",
    ]
    got: list[bytes] = []
    writer = type("W", (), {"drained": None, "write": staticmethod(lambda data: got.append(data) or True)})()
    rec, outcome = RequestRecord("r", "completion"), Outcome()
    sink = _Relayed(writer, rec, outcome)  # type: ignore[arg-type]
    for event in events:
        assert sink.write(event)
    assert got == events and outcome.answered
    assert rec.output_tokens is None and rec.cached_tokens is None and rec.token_events == 1
    whole = RequestRecord("r", "completion")
    whole.sent_body(b'{"id":"x","choices":[{"text":"a"}],' + usage + b"}")
    assert whole.output_tokens is None and whole.cached_tokens is None


def test_pool_signals_drop_stale_engine_reports_and_removed_endpoints():
    pools = Pools(["http://p:1"], ["http://d:1", "http://d:2"], stats_max_age_s=5.0)
    metrics = GatewayMetrics(pools)
    now = time.monotonic()
    pools.decode[0].stats = EngineStats(running=3, waiting=1, kv_usage=0.5, block_size=16, at=now)
    pools.decode[1].stats = EngineStats(running=5, waiting=2, kv_usage=0.9, block_size=16, at=now - 60)  # stale
    pools.prefill[0].stats = EngineStats(running=1, waiting=0, kv_usage=0.2, block_size=16, at=now - 60)
    text = metrics.render().decode()
    assert sample(text, "pdgate_pool_engine_running_requests", pool="decode") == 3
    assert sample(text, "pdgate_pool_kv_usage_ratio", pool="decode") == 0.5
    assert sample(text, "pdgate_pool_reporting_endpoints", pool="decode") == 1
    # No fresh report from the prefill pool: no value at all (an autoscaler keeps its scale), not 0.
    assert 'pdgate_pool_kv_usage_ratio{pool="prefill"}' not in text
    assert 'pdgate_pool_engine_waiting_requests{pool="prefill"}' not in text
    pools.update(["http://p:1"], ["http://d:1"])
    text = metrics.render().decode()
    assert 'engine="http://d:2"' not in text  # an engine that left leaves no series behind
    assert 'pdgate_endpoint_healthy{engine="http://d:1",pool="decode"}' in text


def test_pd_metrics_and_pool_signals(client, eng):
    script_pd(eng)
    before = client.get("/metrics").text
    assert client.post("/v1/completions", json={"model": "tiny", "prompt": LONG}).status_code == 200
    after = client.get("/metrics").text
    assert (
        sample(after, "pdgate_prefill_leg_duration_seconds_count", model="tiny", outcome="ok")
        == sample(before, "pdgate_prefill_leg_duration_seconds_count", model="tiny", outcome="ok") + 1
    )
    assert (
        sample(after, "pdgate_output_tokens_total", model="tiny", path="pd")
        == sample(before, "pdgate_output_tokens_total", model="tiny", path="pd") + 1
    )  # usage of the body
    assert sample(after, "pdgate_pool_healthy_endpoints", pool="prefill") == 2
    assert sample(after, "pdgate_pool_healthy_endpoints", pool="decode") == 1
    # Nothing in flight any more: no request, no prompt tokens waiting for prefill.
    for pool in ("prefill", "decode"):
        assert sample(after, "pdgate_pool_in_flight_requests", pool=pool) == 0
        assert sample(after, "pdgate_pool_uncached_prompt_tokens", pool=pool) == 0


def test_one_json_access_line_per_request(client, eng, access_lines):
    script_pd(eng)
    access_lines.clear()
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": LONG}, headers={"x-request-id": "req-42"})
    bad = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 200 and bad.status_code == 400
    prefill, decode = chosen_prefill(eng), eng[2]
    lines = [json.loads(raw) for raw in access_lines]
    assert len(lines) == 2
    ok, refused = lines
    assert ok["request_id"] == "req-42" and ok["status"] == 200 and ok["path"] == "pd"
    assert ok["reason"] == "long_uncached" and ok["decode"] == decode.url and ok["prefill"] == prefill.url
    assert ok["prompt_tokens"] == int(r.headers["x-pdgate-prompt-tokens"]) and ok["output_tokens"] == 1
    assert ok["trace_id"] and ok["total_ms"] >= ok["prefill_ms"] > 0
    assert refused["status"] == 400 and refused["path"] == "none" and refused["error"]


def test_tracing_off_passes_the_clients_trace_on_unchanged(tokenizer_dir, engines):
    engines[2].reset()
    cfg = parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
            "pools": {"decode": {"endpoints": [engines[2].url]}},
        }
    )
    client_parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    with TestClient(create_app(cfg, access_sink=lambda line: None)) as c:
        for headers in (
            {"traceparent": client_parent, "tracestate": "vendor=abc"},
            {"traceparent": "00-not-a-trace\r\nx-evil: 1"},
            {},
        ):
            engines[2].reply("/v1/completions", completion("hi"))
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello"}, headers=headers)
            assert r.status_code == 200
    good, bad, none = (p.headers for p in engines[2].posts("/v1/completions"))
    assert good["traceparent"] == client_parent and good["tracestate"] == "vendor=abc"
    assert "traceparent" not in bad and "x-evil" not in bad  # malformed: not passed on
    assert "traceparent" not in none


def test_cost_model_predictions_are_route_attributes(tokenizer_dir, engines, exporter):
    for e in engines:
        e.reset()
    engines[2].reply("/v1/completions", completion("hi"))
    engines[0].reply("/v1/completions", completion(kv=KV))
    engines[1].reply("/v1/completions", completion(kv=KV))
    engines[2].reply("/v1/completions", completion("hi"))
    cfg = parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
            "pools": {
                "prefill": {"endpoints": [engines[0].url, engines[1].url]},
                "decode": {"endpoints": [engines[2].url]},
            },
            "routing": {"decider": {"name": "cost_model"}, "prefix": {"enabled": False}},
        }
    )
    exporter.clear()
    with TestClient(create_app(cfg, span_exporter=exporter)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": LONG})
    assert r.status_code == 200
    _, kids = tree(exporter)
    attrs = kids["route"][0].attributes
    assert attrs["pdgate.reason"] in ("pd_faster", "direct_faster")
    assert attrs["pdgate.predicted_ttft_direct_s"] >= 0 and attrs["pdgate.predicted_ttft_pd_s"] >= 0
    assert (attrs["pdgate.predicted_ttft_pd_s"] < attrs["pdgate.predicted_ttft_direct_s"]) == (
        attrs["pdgate.path"] == "pd"
    )


@pytest.mark.parametrize(
    "telemetry, where",
    [
        ({"tracing": {"exporter": "jaeger"}}, "telemetry.tracing.exporter"),
        ({"tracing": {"sample_ratio": 1.5}}, "telemetry.tracing.sample_ratio"),
        ({"access_log": "sometimes"}, "telemetry.access_log"),
    ],
)
def test_bad_telemetry_settings_are_refused_with_their_location(telemetry, where):
    with pytest.raises(ConfigError, match=where):
        parse_config(
            {
                "models": [{"name": "m", "tokenizer": "t", "max_model_len": 8}],
                "pools": {"decode": {"endpoints": ["http://127.0.0.1:1"]}},
                "telemetry": telemetry,
            }
        )


def test_otlp_export_carries_headers_from_config_and_environment(monkeypatch):
    got: list[dict[str, str]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            got.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTLP_HEADERS_TEST", "authorization=Bearer s3cret, x-team = llm")
        tracing = Tracing(
            TracingConfig(
                exporter="otlp",
                endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces",
                headers={"x-from-file": "1"},
                headers_env="OTLP_HEADERS_TEST",
            )
        )
        tracing.start("POST /v1/completions", {}, {}).end(200)
        tracing.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()
    [headers] = got
    assert headers["authorization"] == "Bearer s3cret" and headers["x-team"] == "llm"
    assert headers["x-from-file"] == "1" and headers["content-type"] == "application/x-protobuf"


async def test_access_lines_are_written_whole_in_order_and_flushed_at_close():
    out = io.BytesIO()
    writer = LineWriter(out, interval_s=0.01)
    for i in range(1000):
        writer(b'{"n":%d}' % i)
        if i % 100 == 0:
            await asyncio.sleep(0.02)  # some batches go out while requests keep coming
    writer.close()
    assert [json.loads(x)["n"] for x in out.getvalue().splitlines()] == list(range(1000))
