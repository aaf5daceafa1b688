"""A part's engine legs with failover (gateway/request/engine_legs.py), driven through the real ASGI
endpoint against scripted engine legs: a failed prefill leg tried on another prefill engine, then
direct, or its error the answer; a decode leg that failed before its first token tried elsewhere,
with or without the KV handle; and what the client's headers, the access log, the hooks and the
tenant's use say about each leg."""

from __future__ import annotations

from gateway.engines.upstream import EngineError
from policies.base import LegOutcome, Path
from tests.promtext import sample

from .exchange_harness import D2, KV, D, P, answer, completion, make, unreachable
from .test_exchange import LONG, settled

P2 = "http://p2:1"


def engine_error() -> EngineError:
    return EngineError(502, "The prefill engine failed (HTTP 500).", code="engine_error")


async def test_a_failed_prefill_leg_is_tried_on_another_prefill_engine(tokenizer_dir):
    h = make(tokenizer_dir, pools={"prefill": {"endpoints": [P, P2]}, "decode": {"endpoints": [D, D2]}})
    try:
        h.upstream.on("prefill", engine_error(), answer(completion("x", kv=KV)))
        h.upstream.on("decode", answer(completion("served")))
        r = await h.send({"model": "tiny", "prompt": LONG})
        assert r.status == 200 and r.json()["choices"][0]["text"] == "served"
        assert r.headers["x-pdgate-path"] == "pd" and r.headers["x-pdgate-failover"] == "prefill_retried"
        first, second, decode = h.recorder.legs()
        assert (first.leg, first.outcome, second.leg, second.outcome) == (
            "prefill",
            LegOutcome.FAILED,
            "prefill",
            LegOutcome.OK,
        )
        assert first.url != second.url and (decode.prefill_url, decode.path) == (second.url, Path.PD)
        [line] = h.access
        assert line["prefill"] == second.url and line["failover"] == ["prefill_retried"]
        settled(h)
    finally:
        h.close()


async def test_with_no_other_prefill_engine_the_request_goes_direct(h):
    h.upstream.on(P, engine_error())
    h.upstream.on("decode", answer(completion("served")))
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.headers["x-pdgate-path"] == "direct"
    assert r.headers["x-pdgate-failover"] == "prefill_fallback_direct"
    (_, _, decode_body) = h.upstream.calls[-1]
    assert "kv_transfer_params" not in decode_body  # the decode engine computes the prompt itself
    [line] = h.access
    assert line["path"] == "direct" and line["prefill"] is None
    fallbacks = sample(h.metrics.render().decode(), "pdgate_failovers_total", event="prefill_fallback_direct")
    assert fallbacks == 1
    settled(h)


async def test_without_the_fallback_a_failed_prefill_is_the_clients_answer(tokenizer_dir):
    h = make(tokenizer_dir, failover={"fallback_to_direct": False})
    try:
        h.upstream.on(P, engine_error())
        r = await h.send({"model": "tiny", "prompt": LONG})
        assert r.status == 502 and r.json()["error"]["code"] == "engine_error"
        assert "x-pdgate-path" not in r.headers and [c[1] for c in h.upstream.calls] == ["prefill"]
        [line] = h.access
        assert (line["status"], line["prefill"]) == (502, P)
        settled(h)
    finally:
        h.close()


async def test_a_decode_engine_that_never_saw_the_request_leaves_the_kv_handle_to_the_next(h):
    """Connection refused: the prefilled blocks are untouched, so the other decode engine pulls them."""
    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on("decode", unreachable(), answer(completion("served")))
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.headers["x-pdgate-path"] == "pd"
    assert r.headers["x-pdgate-failover"] == "decode_retried"
    _, first, second = h.upstream.calls
    assert first[0] != second[0] and second[2]["kv_transfer_params"] == KV
    assert [leg.outcome for leg in h.recorder.legs()] == [LegOutcome.OK, LegOutcome.UNREACHED, LegOutcome.OK]
    settled(h)


async def test_every_decode_leg_gives_its_tenants_use_back(h):
    """Each decode leg counts in its tenant's decode occupancy while it runs, a failed one too."""
    h.upstream.on("decode", unreachable(), answer(completion("served")))
    assert (await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 5})).status == 200
    [line] = h.access
    usage = h.gateway.services.usage
    assert usage.local("occupancy", line["tenant"]) == 0 and usage.local("gateway", line["tenant"]) == 0
    assert usage.local("decode", line["tenant"]) > 0  # the answer's use, settled
    settled(h)
