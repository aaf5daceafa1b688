"""One trace from the gateway into real vLLM engines: each engine, started with
``--otlp-traces-endpoint``, joins the ``traceparent`` its leg sent and exports its own
``llm_request`` span as a child of that leg's span (vLLM's tracing, not the simulator's)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.otlp import attrs
from tests.procs import wait_for

from . import engines as E
from .conftest import Gateway, Pair, start_gateway

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

WORDS = ("the", "prefill", "pool", "computes", "the", "prompt", "and", "the", "decode", "pool", "streams")


@pytest.fixture(scope="module")
def traced_gateway(vllm_pair: Pair) -> Iterator[Gateway]:
    routing = {"decider": {"name": "token_threshold", "threshold": 512}, "prefix": {"enabled": False}}
    tracing = {"tracing": {"exporter": "otlp", "endpoint": vllm_pair.collector.url}}
    gw = start_gateway(vllm_pair, "traced-gateway", routing=routing, telemetry=tracing)
    try:
        yield gw
    finally:
        gw.proc.stop()


def _trace_of(pair: Pair, request_id: str) -> str | None:
    for s in list(pair.collector.spans):
        if s.name.startswith("POST ") and attrs(s).get("pdgate.request_id") == request_id:
            return s.trace_id.hex()
    return None


@pytest.mark.parametrize(("words", "path"), [(700, "pd"), (8, "direct")], ids=["pd", "direct"])
def test_engines_nest_their_request_spans_under_the_gateway_legs(vllm_pair, traced_gateway, words, path):
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    content = " ".join([uuid.uuid4().hex, *(WORDS[i % len(WORDS)] for i in range(words))])
    body = {
        "model": E.MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    r = httpx.post(
        traced_gateway.url + "/v1/chat/completions",
        json=body,
        headers={"x-request-id": rid},
        timeout=E.REQUEST_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == path

    legs = ("prefill", "decode") if path == "pd" else ("decode",)
    collector = vllm_pair.collector

    def trace() -> dict[str, list]:
        trace_id = _trace_of(vllm_pair, rid)
        by_name: dict[str, list] = {}
        for s in collector.trace(trace_id) if trace_id else []:
            by_name.setdefault(s.name, []).append(s)
        return by_name

    # Spans leave in batches (the gateway's every 5 s, the engines' every 0.2 s).
    assert wait_for(
        lambda: len(trace().get("llm_request", [])) == len(legs) and all(leg in trace() for leg in legs), timeout=30
    ), sorted(trace())
    spans = trace()
    engine_spans = spans["llm_request"]
    # Each engine's span is the child of the leg that called it.
    assert sorted(s.parent_span_id for s in engine_spans) == sorted(spans[leg][0].span_id for leg in legs)
    for s in engine_spans:
        # vLLM's own span (its resource names the vLLM module), carrying the gateway's request id.
        assert "vllm.instrumenting_module_name" in collector.resources[s.span_id]
        assert rid in attrs(s)["gen_ai.request.id"]
