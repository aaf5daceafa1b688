"""The request lifecycle: one ``Exchange`` per request, driven through its real ASGI endpoint against
scripted engine legs. What a user or operator would notice: the answer, the headers, the admission
slot and engine counts given back on every path, and the hooks told what happened, in order."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from gateway.engines.upstream import EngineError, EngineGone
from gateway.fairness.admission import LoopLag
from policies.base import LegOutcome, Path
from tests.promtext import sample
from tests.waiting import until

from .exchange_harness import D2, KV, D, FakeResponse, P, answer, completion, make, stream, unreachable

LONG = "def handler(request):\n    return request.body\n" * 40  # well over the threshold (64 tokens)


def kinds(h) -> list[str]:
    return [kind for kind, _ in h.recorder.events]


def settled(h) -> None:
    """Everything a request took is given back."""
    assert h.gate.in_flight == 0
    assert all(ep.in_flight == 0 and ep.backlog_tokens == 0 for ep in h.pools.all())
    assert len(h.beliefs.in_flight) == 0 and h.beliefs._open == {}


async def test_direct_request_tells_every_hook_once_in_order(h):
    h.upstream.on("decode", answer(completion("hi")))
    r = await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status == 200 and r.headers["x-pdgate-path"] == "direct" and r.json()["choices"][0]["text"] == "hi"
    assert kinds(h) == ["routed", "leg", "finished"]
    [leg] = h.recorder.legs()
    assert (leg.leg, leg.outcome, leg.path, leg.status) == ("decode", LegOutcome.OK, Path.DIRECT, 200)
    finished = h.recorder.events[-1][1]
    assert (finished.status, finished.path, finished.legs) == (200, "direct", (leg,))
    settled(h)


async def test_pd_stream_reports_both_legs_and_the_hand_over(h):
    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on("decode", stream("a", "b"))
    r = await h.send({"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": True})
    assert r.status == 200 and r.headers["x-pdgate-path"] == "pd"
    assert r.body.endswith(b"data: [DONE]\n\n")
    prefill, decode = h.recorder.legs()
    assert (prefill.leg, prefill.outcome, prefill.cached_tokens) == ("prefill", LegOutcome.OK, 0)
    assert (decode.leg, decode.outcome, decode.path, decode.prefill_url) == ("decode", LegOutcome.OK, Path.PD, P)
    assert decode.first_token_s is not None and decode.cached_tokens is None  # vLLM reports P's hit there
    # Confirmed on both engines: the next turn finds them holding the prompt.
    assert set((await _plan(h, LONG))["settled_tokens"]) == {P, decode.url}
    settled(h)


async def test_a_rejected_prefill_is_the_clients_answer_and_teaches_nothing(h):
    """Reproduction 3 of issue 12: the engine refuses the request (4xx); the prompt must not count
    as cached anywhere afterwards, so the same prompt later still takes the P/D path."""
    h.upstream.on(P, EngineError(400, "logprobs too large", code="engine_rejected"))  # as Upstream.post raises
    r = await h.send({"model": "tiny", "prompt": LONG, "logprobs": 100})
    assert r.status == 400 and r.json()["error"]["message"] == "logprobs too large"
    assert "x-pdgate-path" not in r.headers
    [leg] = h.recorder.legs()
    assert (leg.leg, leg.outcome) == ("prefill", LegOutcome.REJECTED)
    assert h.index.stats().approximate == 0
    settled(h)
    # The same prompt again: still long and uncached, so P/D (it would be "direct, prefix_cached"
    # had the refused request been learned).
    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on("decode", answer(completion("y")))
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.headers["x-pdgate-path"] == "pd"


async def test_an_unreachable_decode_engine_is_retried_on_the_other_one(h):
    h.upstream.on("decode", unreachable(), answer(completion("served")))
    r = await h.send({"model": "tiny", "prompt": "hello"})
    assert r.status == 200 and r.headers["x-pdgate-failover"] == "decode_retried"
    first, second = h.recorder.legs()
    assert first.outcome is LegOutcome.UNREACHED and second.outcome is LegOutcome.OK
    assert first.url != second.url
    settled(h)


async def test_a_stream_that_breaks_off_ends_with_an_error_event_then_done(h):
    """As vLLM ends a stream that fails: the error event, then ``data: [DONE]``."""
    h.upstream.on("decode", stream("a", "b", "c", break_after=2))
    r = await h.send({"model": "tiny", "prompt": "hello", "stream": True})
    assert r.status == 200
    events = [e for e in r.body.split(b"\n\n") if e]
    assert events[:2] == [b'data: {"choices":[{"text":"a"}]}', b'data: {"choices":[{"text":"b"}]}']
    assert orjson.loads(events[2].removeprefix(b"data: "))["error"]["code"] == "engine_error"
    assert events[3] == b"data: [DONE]"
    [leg] = h.recorder.legs()
    assert leg.outcome is LegOutcome.CUT and leg.prefilled  # it had prefilled: its cache holds the prompt
    assert h.recorder.events[-1][1].status == 502
    settled(h)


async def test_a_client_leaving_mid_stream_closes_the_engine_leg_and_frees_everything(h):
    resp = stream("a", "b", hold_after=1)  # the engine goes quiet after its first chunk
    h.upstream.on("decode", resp)
    leave = asyncio.Event()
    sent: list[dict] = []

    async def hang_up_after_first_chunk() -> None:
        await until(lambda: any(m.get("body") for m in sent))
        leave.set()

    hanger = asyncio.create_task(hang_up_after_first_chunk())
    await asyncio.wait_for(h.send({"model": "tiny", "prompt": "hello", "stream": True}, leave=leave, sent=sent), 5)
    await hanger
    [leg] = h.recorder.legs()
    assert leg.outcome is LegOutcome.CUT
    assert resp.closed  # the connection dropped: vLLM aborts the request
    assert h.recorder.events[-1][1].status == 499
    settled(h)


async def test_a_client_leaving_right_after_done_got_its_whole_answer(h):
    """Clients (the openai SDK among them) close the connection once they read [DONE]: that is a
    whole answer, counted 200, not a hang-up."""
    resp = stream("a", "b", hold_after=3)  # [DONE] is out; the engine has not closed its stream yet
    h.upstream.on("decode", resp)
    leave = asyncio.Event()
    sent: list[dict] = []

    async def hang_up_after_done() -> None:
        await until(lambda: any(m.get("body", b"").endswith(b"data: [DONE]\n\n") for m in sent))
        leave.set()

    hanger = asyncio.create_task(hang_up_after_done())
    await asyncio.wait_for(h.send({"model": "tiny", "prompt": "hello", "stream": True}, leave=leave, sent=sent), 5)
    await hanger
    [leg] = h.recorder.legs()
    assert leg.outcome is LegOutcome.OK
    assert h.recorder.events[-1][1].status == 200
    assert sample(h.metrics.render().decode(), "pdgate_requests_total", status="200") == 1
    settled(h)


async def test_a_client_leaving_during_prefill_abandons_it_and_learns_nothing(h):
    gate = asyncio.Event()
    held = answer(completion("x", kv=KV), gate=gate)
    h.upstream.on(P, held)
    leave = asyncio.Event()

    async def hang_up() -> None:
        await until(lambda: h.upstream.calls)
        await asyncio.sleep(0.05)  # past the disconnect watch's start (WATCH_AFTER_S)
        leave.set()

    hanger = asyncio.create_task(hang_up())
    await asyncio.wait_for(h.send({"model": "tiny", "prompt": LONG}, leave=leave), 5)
    await hanger
    [leg] = h.recorder.legs()
    assert (leg.leg, leg.outcome) == ("prefill", LegOutcome.ABANDONED)
    assert held.closed and h.index.stats().approximate == 0
    assert h.recorder.events[-1][1].status == 499
    settled(h)


@pytest.mark.parametrize(
    ("fields", "streamed"),
    [
        ({"stream": True}, True),
        ({}, True),  # migratable: its engine streams (the client gets a whole answer), so the first token shows
        ({"logprobs": 1}, False),  # not migratable: the engine sends a whole answer
    ],
)
async def test_a_direct_stream_is_decode_backlog_until_its_first_token(h, fields, streamed):
    """A stream's first token shows when its prefill is done; a whole answer's does not, so it never counts."""
    gate = asyncio.Event()
    body = completion("x")
    for url in (D, D2):
        h.upstream.on(url, stream("a", gate=gate) if streamed else answer(body, gate=gate))
    prompt = "def handler(request):\n    return request.body\n" * 4  # under the threshold: direct
    task = asyncio.create_task(h.send({"model": "tiny", "prompt": prompt, **fields}))
    await until(lambda: h.upstream.calls)
    ep = next(e for e in h.pools.decode if e.url == h.upstream.calls[0][0])
    assert bool(h.upstream.calls[0][2].get("stream")) is streamed
    assert ep.in_flight == 1
    assert (ep.backlog_tokens > 0) is streamed
    gate.set()
    assert (await task).status == 200
    settled(h)


async def test_a_short_whole_answer_goes_as_sent_and_is_not_decode_backlog(tokenizer_dir):
    """By default (routing.migration.non_streaming_min_tokens) a short non-streamed request goes to
    its engine as sent: a whole answer, whose first token cannot be seen, so it never counts."""
    h = make(tokenizer_dir, routing={"decider": {"name": "token_threshold", "threshold": 64}})
    try:
        gate = asyncio.Event()
        for url in (D, D2):
            h.upstream.on(url, answer(completion("x"), gate=gate))
        prompt = "def handler(request):\n    return request.body\n" * 4  # under the threshold: direct
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8}
        task = asyncio.create_task(h.send(body))
        await until(lambda: h.upstream.calls)
        ep = next(e for e in h.pools.decode if e.url == h.upstream.calls[0][0])
        assert h.upstream.calls[0][2] == body and ep.in_flight == 1 and ep.backlog_tokens == 0
        gate.set()
        assert (await task).status == 200
        settled(h)
    finally:
        h.close()


async def test_a_burst_sees_a_prompt_in_flight_as_cached_and_a_failure_takes_it_back(h):
    """Tentative beliefs: while the first request's leg runs, an identical prompt counts as cached on
    its engines (a burst follows it); when that leg fails before its first token, it no longer does."""
    gate = asyncio.Event()
    h.upstream.on(P, answer(completion("x", kv=KV), gate=gate))
    first = asyncio.create_task(h.send({"model": "tiny", "prompt": LONG}))
    await until(lambda: h.upstream.calls)
    plan = await _plan(h, LONG)
    assert plan["settled_tokens"] == {} and set(plan["cached_tokens"]) == {P, plan["decode"]}
    h.upstream.on("decode", unreachable(), unreachable())  # its decode leg fails before its first token
    gate.set()
    assert (await first).status == 502
    for ep in h.pools.decode:
        ep.mark_up()  # refused connections marked them down
    plan = await _plan(h, LONG)
    # The prefill engine did compute it (confirmed); neither decode engine got it (retracted).
    assert set(plan["cached_tokens"]) == {P} and plan["path"] == "pd"
    settled(h)


async def _plan(h, prompt: str) -> dict:
    from starlette.requests import Request

    raw = orjson.dumps({"model": "tiny", "prompt": prompt})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/debug/route",
        "query_string": b"kind=completion",
        "headers": [],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    return await h.gateway.explain(Request(scope, receive))


async def test_a_hook_that_raises_never_reaches_the_request(h):
    class Broken:
        def on_leg_done(self, ctx, leg):
            raise RuntimeError("plugin bug")

    from policies.hooks import Hooks

    rt = h.gateway.runtime
    hooks = Hooks([("broken", Broken()), ("recorder", h.recorder)], lambda *a: h.hook_errors.append(a))
    h.gateway.runtime = type(rt)(rt.cfg, rt.version, rt.router, rt.upstream, rt.tokenizers, hooks)
    h.upstream.on("decode", answer(completion()), answer(completion()))
    assert (await h.send({"model": "tiny", "prompt": "hello"})).status == 200
    assert (await h.send({"model": "tiny", "prompt": "hello"})).status == 200
    assert h.hook_errors == [("broken", "on_leg_done")] * 2
    assert kinds(h) == ["routed", "leg", "finished"] * 2  # later subscribers still told


async def test_unknown_model_and_bad_body_end_before_routing_with_no_hooks(h):
    r = await h.send({"model": "nope", "prompt": "x"})
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.headers["x-request-id"]
    r = await h.send({"model": "tiny", "prompt": 5})
    assert r.status == 400
    assert h.recorder.events == [] and h.upstream.calls == []
    settled(h)


async def test_an_engine_serving_other_models_is_left_out(h):
    """What /v1/models says an engine serves is a belief the router acts on."""
    h.pools.set_served(h.pools.decode[0], frozenset({"other"}))
    h.upstream.on("decode", *(answer(completion()) for _ in range(3)))
    for _ in range(3):
        assert (await h.send({"model": "tiny", "prompt": "hello"})).status == 200
    assert {url for url, _, _ in h.upstream.calls} == {h.pools.decode[1].url}
    h.pools.set_served(h.pools.decode[1], frozenset({"other"}))
    r = await h.send({"model": "tiny", "prompt": "hello"})
    assert r.status == 503 and r.json()["error"]["code"] == "model_not_served"


async def test_an_overloaded_loop_answers_429_and_sends_nothing(tokenizer_dir):
    """admission.max_loop_lag_ms (100 by default): while the loop runs later than that for
    overload_hold_s, a new request would only slow every stream further; it gets 429 at once."""
    h = make(tokenizer_dir, admission={"overload_hold_s": 0.2})
    try:
        await _overloaded_then_not(h)
    finally:
        h.close()


async def test_a_burst_shorter_than_the_hold_is_served_and_a_longer_one_is_shed(tokenizer_dir):
    """A burst makes the loop late for a moment (the streams it opens then run within capacity):
    requests during it are served. Late for longer than overload_hold_s, they are refused."""
    h = make(tokenizer_dir, admission={"overload_hold_s": 0.3})
    try:
        lag = h.gateway.services.lag
        for _ in range(10):
            lag.note(0.2)  # 200 ms late: past the bound, but only just now
        h.upstream.on("decode", answer(completion("hi")))
        assert (await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})).status == 200
        await asyncio.sleep(0.35)
        lag.note(0.2)  # still late, past the hold now
        r = await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})
        assert r.status == 429 and "overloaded" in r.json()["error"]["message"]
        for _ in range(20):
            lag.note(0.0)
        for _ in range(5):
            lag.note(1.5)  # (smoothed) over five times the bound: no hold
        assert lag.over(100, 0.3)
        settled(h)
    finally:
        h.close()


async def _overloaded_then_not(h) -> None:
    lag = h.gateway.services.lag
    lag.note(0.2)
    assert not lag.over(100)  # one late tick is a hiccup
    for _ in range(10):
        lag.note(0.2)  # the loop keeps running 200 ms late
    await asyncio.sleep(0.25)
    lag.note(0.2)
    r = await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "overloaded" in r.json()["error"]["message"]
    assert h.upstream.calls == []
    text = h.metrics.render().decode()
    assert sample(text, "pdgate_admission_rejected_total", reason="overloaded") == 1
    for _ in range(20):
        lag.note(0.0)  # the loop keeps up again
    h.upstream.on("decode", answer(completion("hi")))
    r = await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status == 200
    settled(h)


async def test_the_lag_bound_can_be_switched_off(tokenizer_dir):
    h = make(tokenizer_dir, admission={"max_loop_lag_ms": 0})
    try:
        h.gateway.services.lag.note(5.0)
        h.upstream.on("decode", answer(completion("hi")))
        assert (await h.send({"model": "tiny", "prompt": "hello", "max_tokens": 2})).status == 200
    finally:
        h.close()


async def test_loop_lag_is_measured_on_the_running_loop():
    lag = LoopLag(interval_s=0.005)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        assert lag.lag_s < 0.05
        for _ in range(4):
            time.sleep(0.2)  # noqa: ASYNC251 - a blocked loop, as a saturated one is
            await asyncio.sleep(0.001)  # the lag timer, overdue, fires first
        assert lag.over(100) and lag.peak_s >= 0.15
    finally:
        await lag.stop()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_chat_stream_failing_right_after_its_role_chunk_is_retried(h, stream):
    """vLLM's chat streams send the role chunk before anything else, a failed KV load too (then the
    error event): that is a failure before the first token, retried on another engine."""
    role = (
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant",'
        b'"content":""},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    error = b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
    # the role chunk arrives in two reads (a long prompt's ids make it large), the error with the second
    failed = FakeResponse([role[:40], role[40:] + error, b"data: [DONE]\n\n"], content_type=b"text/event-stream")
    ok = FakeResponse(
        [
            role,
            b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},'
            b'"finish_reason":"length","token_ids":[5]}]}\n\n',
            b"data: [DONE]\n\n",
        ],
        content_type=b"text/event-stream",
    )
    h.upstream.on("decode", failed, ok)
    r = await h.send(
        {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "stream": stream}, kind="chat"
    )
    assert r.status == 200 and r.headers["x-pdgate-failover"] == "decode_retried"
    assert b'"error"' not in r.body and ok.released
    assert [leg.outcome for leg in h.recorder.legs()] == [LegOutcome.FAILED, LegOutcome.OK]
    settled(h)


async def test_a_decode_engine_is_not_charged_when_its_kv_source_died(h):
    """The prefill engine dies while the decode engine pulls its KV: the leg's failure is not the
    decode engine's, so failures like it (every P/D leg pulling from that engine) do not eject it."""
    prefill = next(ep for ep in h.pools.prefill if ep.url == P)
    decode = next(ep for ep in h.pools.decode if ep.url == D)

    def source_gone(_body: dict) -> EngineError:
        prefill.mark_down("connect failed")
        return EngineError(504, "The decode engine did not answer in time.", code="engine_timeout")

    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on(D, source_gone)
    h.upstream.on(D2, answer(completion("served")))  # the retry, direct
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.headers["x-pdgate-failover"] == "decode_retried"
    assert not decode.outcomes or all(decode.outcomes), list(decode.outcomes)  # no failure charged to it
    settled(h)


async def test_a_pd_decode_leg_failing_with_no_other_engine_left_is_retried_there_direct(h):
    """The other decode engine is down; the first one's P/D leg fails before its first token (its
    KV source, the prefill engine, may be what died): the same engine computes the prompt itself."""
    next(ep for ep in h.pools.decode if ep.url == D2).mark_down("connect failed")
    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on(
        D, EngineError(502, "The decode engine failed (HTTP 500).", code="engine_error"), answer(completion("served"))
    )
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.json()["choices"][0]["text"] == "served"
    assert r.headers["x-pdgate-failover"] == "decode_retried" and r.headers["x-pdgate-path"] == "direct"
    first, second = [c for c in h.upstream.calls if c[1] == "decode"]
    assert first[0] == second[0] == D
    assert "kv_transfer_params" in first[2] and "kv_transfer_params" not in second[2]
    settled(h)


async def test_a_pd_decode_engine_gone_before_its_first_byte_is_unreachable_yet_had_the_request(h):
    """An engine killed while it held the request: counted as unreachable (its next connect
    fails too), but it may have pulled the prompt's KV, so the next engine computes it itself."""
    h.upstream.on(P, answer(completion("x", kv=KV)))
    h.upstream.on(
        "decode",
        EngineGone(502, "The decode engine closed the connection before answering.", code="engine_unreachable"),
        answer(completion("served")),
    )
    before = sample(
        h.metrics.render().decode(), "pdgate_failovers_total", event="decode_retried", cause="engine_unreachable"
    )
    r = await h.send({"model": "tiny", "prompt": LONG})
    assert r.status == 200 and r.headers["x-pdgate-failover"] == "decode_retried"
    first, second = [c for c in h.upstream.calls if c[1] == "decode"]
    assert first[0] != second[0] and "kv_transfer_params" not in second[2]
    assert (
        sample(
            h.metrics.render().decode(), "pdgate_failovers_total", event="decode_retried", cause="engine_unreachable"
        )
        == before + 1
    )
    settled(h)
