"""Mid-stream migration in the request lifecycle, driven through the real ASGI endpoint against
scripted decode engines that stream vLLM 0.32's events (tests/gateway/vllm_events.py). A
continuation's engine is scripted as greedy decoding is: from whatever prompt it is sent, it
generates the tokens the first engine would have. What a client or an operator notices: one
uninterrupted answer (or, where migration does not apply, the error event as before), the other
engine given the prompt plus the output kept, every slot and count given back, the hooks told about
both parts, and the migration counted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest
from tokenizers import Tokenizer

from gateway.engines.upstream import EngineError
from gateway.request.protocol import parse_body
from policies.base import LegOutcome, Path
from tests.promtext import sample
from tests.waiting import until

from .exchange_harness import KV, FakeResponse, Harness, P, answer, completion, make
from .test_exchange import LONG, settled
from .vllm_events import client_text, events, full_text

TEXT = "def handler(request):\n    return request.body  # héllo wörld\n" * 6


def prompt_ids(h: Harness, body: dict, kind: str) -> list[int]:
    return h.tokenizers.get("tiny").prompt_ids(parse_body(orjson.dumps(body), kind))[0]  # type: ignore[union-attr]


def breaking(tok: Tokenizer, prompt: list[int], gen: list[int], kind: str, after: int, **kw) -> FakeResponse:
    """The first engine: streams, then its connection breaks after ``after`` events."""
    return FakeResponse(events(tok, prompt, gen, kind=kind, **kw), content_type=b"text/event-stream", break_after=after)


def greedy(tok: Tokenizer, prompt: list[int], gen: list[int], **kw) -> Callable[[dict], FakeResponse]:
    """A continuation's engine: from the prompt it is sent (the original plus kept tokens), the
    rest of ``gen``, as a completions stream."""

    def respond(body: dict) -> FakeResponse:
        kept = body["prompt"][len(prompt) :]
        assert body["prompt"][: len(prompt)] == prompt and kept == gen[: len(kept)]
        return FakeResponse(
            events(tok, body["prompt"], gen[len(kept) :], kind="completion", rid="other", **kw),
            content_type=b"text/event-stream",
        )

    return respond


def migrations(h: Harness, result: str, reason: str = "disconnected") -> float:
    return sample(h.metrics.render().decode(), "pdgate_migrations_total", reason=reason, result=result)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_leg_broken_mid_answer_goes_on_on_the_other_engine(h, tok, kind, stream):
    body = (
        {"model": "tiny", "messages": [{"role": "user", "content": "Write a handler."}]}
        if kind == "chat"
        else {"model": "tiny", "prompt": "Write a handler."}
    )
    gen = tok.encode(TEXT, add_special_tokens=False).ids
    body.update(max_tokens=len(gen), stream=stream)
    prompt = prompt_ids(h, body, kind)
    h.upstream.on("decode", breaking(tok, prompt, gen, kind, after=12), greedy(tok, prompt, gen, usage=True))
    r = await h.send(body, kind=kind)
    assert r.status == 200 and r.headers["x-pdgate-path"] == "direct"
    assert r.headers["content-type"] == ("text/event-stream" if stream else "application/json")
    if stream:
        assert client_text(r.body, kind) == full_text(tok, prompt, gen)
        assert r.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in r.body
    else:
        out = r.json()
        text = out["choices"][0]["message"]["content"] if kind == "chat" else out["choices"][0]["text"]
        assert text == full_text(tok, prompt, gen)
        assert out["usage"]["completion_tokens"] == len(gen) and out["usage"]["prompt_tokens"] == len(prompt)
    first, second = h.upstream.calls
    assert first[0] != second[0]  # the other decode engine
    assert h.upstream.paths[1] == "/v1/completions"  # a chat continues as a completion of its rendered prompt
    kept = len(second[2]["prompt"]) - len(prompt)
    assert 0 < kept < len(gen) and second[2]["max_tokens"] == len(gen) - kept
    assert second[2]["return_token_ids"] is True and "messages" not in second[2]
    # Both parts told to the hooks: the request's own context, then the continuation's.
    legs = h.recorder.legs()
    assert [leg.outcome for leg in legs] == [LegOutcome.CUT, LegOutcome.OK]
    finished = [e for k, e in h.recorder.events if k == "finished"]
    assert [f.continuation for f in finished] == [False, True] and finished[0].output_tokens == len(gen)
    assert migrations(h, "ok") == 1
    assert sample(h.metrics.render().decode(), "pdgate_migrated_tokens_total", model="tiny") == kept
    settled(h)


async def test_a_long_prompt_continues_through_prefill_then_decode(h, tok):
    """The continuation is routed like a request: long, so the prefill engine computes it and the
    other decode engine gets the KV handle."""
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 40, "stream": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:40]
    h.upstream.on(P, answer(completion("x", kv=KV)), answer(completion("x", kv={**KV, "remote_request_id": "r2"})))
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=6), greedy(tok, prompt, gen))
    r = await h.send(body)
    assert r.status == 200 and r.headers["x-pdgate-path"] == "pd"
    assert client_text(r.body, "completion") == full_text(tok, prompt, gen)
    _, dec1, pre2, dec2 = h.upstream.calls
    assert [c[1] for c in h.upstream.calls] == ["prefill", "decode", "prefill", "decode"]
    assert pre2[2]["prompt"] == dec2[2]["prompt"] and pre2[2]["max_tokens"] == 1 and pre2[2]["stream"] is False
    assert "return_token_ids" not in pre2[2]  # the prefill answer would echo the whole prompt
    assert dec2[2]["kv_transfer_params"]["remote_request_id"] == "r2" and dec2[0] != dec1[0]
    assert [leg.path for leg in h.recorder.legs()] == [Path.PD] * 4
    settled(h)


async def test_an_engine_error_event_mid_stream_is_migrated_too(h, tok):
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
    error = b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n'
    failing = [*events(tok, prompt, gen, kind="completion")[:8], error, b"data: [DONE]\n\n"]
    h.upstream.on("decode", FakeResponse(failing, content_type=b"text/event-stream"), greedy(tok, prompt, gen))
    r = await h.send(body)
    assert client_text(r.body, "completion") == full_text(tok, prompt, gen) and b'"error"' not in r.body
    assert migrations(h, "ok", reason="error_event") == 1
    settled(h)


async def test_a_request_that_cannot_migrate_ends_with_the_error_event(h, tok):
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True, "logprobs": 1}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=5, ids=False))
    r = await h.send(body)
    assert r.status == 200
    sent = [e for e in r.body.split(b"\n\n") if e]
    assert orjson.loads(sent[-2][6:])["error"]["code"] == "engine_error" and sent[-1] == b"data: [DONE]"
    assert "return_token_ids" not in h.upstream.calls[0][2]  # its events were relayed untouched
    assert len(h.upstream.calls) == 1
    assert sample(h.metrics.render().decode(), "pdgate_migrations_skipped_total", why="logprobs") == 1
    assert migrations(h, "skipped") == 1
    settled(h)


async def test_a_second_failure_after_one_migration_ends_with_the_error_event(h, tok):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write a handler."}],
        "max_tokens": 60,
        "stream": True,
    }
    prompt = prompt_ids(h, body, "chat")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:60]

    def breaks_too(body: dict) -> FakeResponse:
        resp = greedy(tok, prompt, gen)(body)
        resp.break_after = 4
        return resp

    h.upstream.on("decode", breaking(tok, prompt, gen, "chat", after=6), breaks_too)
    r = await h.send(body, kind="chat")
    sent = [e for e in r.body.split(b"\n\n") if e]
    assert b'"error"' in sent[-2] and sent[-1] == b"data: [DONE]"
    assert full_text(tok, prompt, gen).startswith(client_text(r.body, "chat"))  # no text twice, none lost
    assert len(h.upstream.calls) == 2  # max_per_request: 1
    assert migrations(h, "failed") == 1 and migrations(h, "skipped") == 1
    assert sample(h.metrics.render().decode(), "pdgate_migrations_skipped_total", why="limit") == 1
    # The record says what the client saw: a 200 stream that ended in an error event, after as many
    # tokens as its chunks carried (less the opening role chunk).
    [line] = h.access
    token_chunks = [e for e in sent[:-2] if orjson.loads(e[6:])["choices"]]
    assert (line["status"], line["error_status"]) == (200, 502) and line["error"]
    assert line["output_tokens"] == len(token_chunks) - 1
    assert sample(h.metrics.render().decode(), "pdgate_requests_total", model="tiny", path="direct", status="200") == 1
    settled(h)


async def test_a_migrated_pd_requests_record_keeps_each_parts_prefill(h, tok):
    """The access log's ``prefill_ms`` is the prefill the client's first token waited for; the
    continuation's own prefill is told in its migration's record."""
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 40, "stream": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:40]

    def held(body: dict) -> FakeResponse:  # answers 0.3 s after the leg asks
        slow = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, slow.set)
        return answer(completion("x", kv=KV), gate=slow)

    h.upstream.on(P, held, answer(completion("x", kv={**KV, "remote_request_id": "r2"})))
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=6), greedy(tok, prompt, gen))
    r = await h.send(body)
    assert r.status == 200 and r.headers["x-pdgate-path"] == "pd"
    [line] = h.access
    assert line["prefill_ms"] >= 300  # the first prefill, held 0.3 s (the continuation's was not)
    [m] = line["migrations"]
    assert m["result"] == "ok" and m["path"] == "pd" and m["prefill"] == P and m["prefill_ms"] > 0
    assert line["status"] == 200 and "error_status" not in line
    # both prefill legs are in the prefill histogram
    prefills = sample(
        h.metrics.render().decode(), "pdgate_prefill_leg_duration_seconds_count", model="tiny", outcome="ok"
    )
    assert prefills == 2
    settled(h)


async def test_no_other_decode_engine_ends_with_the_error_event(h, tok):
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
    h.upstream.on(
        "decode", breaking(tok, prompt, gen, "completion", after=5), EngineError(503, "busy", code="engine_error")
    )
    r = await h.send(body)
    assert b'"error"' in r.body and r.body.endswith(b"data: [DONE]\n\n")
    assert migrations(h, "failed") == 1
    settled(h)


async def test_a_client_leaving_during_the_continuations_prefill_frees_everything(h, tok):
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 40, "stream": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:40]
    held = answer(completion("x", kv=KV), gate=asyncio.Event())
    h.upstream.on(P, answer(completion("x", kv=KV)), held)
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=6))
    leave = asyncio.Event()

    async def hang_up() -> None:
        await until(lambda: len(h.upstream.calls) == 3)  # prefill, decode, the continuation's prefill
        leave.set()

    hanger = asyncio.create_task(hang_up())
    await asyncio.wait_for(h.send(body, leave=leave), 5)
    await hanger
    assert held.closed  # the continuation's prefill leg is dropped: the engine aborts it
    assert migrations(h, "abandoned") == 1
    finished = [e for k, e in h.recorder.events if k == "finished"]
    assert [(f.status, f.continuation) for f in finished] == [(499, False), (499, True)]
    settled(h)


async def test_migration_off_relays_every_answer_untouched(tokenizer_dir, tok):
    h = make(
        tokenizer_dir,
        routing={"decider": {"name": "token_threshold", "threshold": 64}, "migration": {"enabled": False}},
    )
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True}
        prompt = prompt_ids(h, body, "completion")
        gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
        h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=5, ids=False))
        r = await h.send(body)
        assert b'"error"' in r.body and h.upstream.calls[0][2] == body
        assert sample(h.metrics.render().decode(), "pdgate_migrations_skipped_total", why="disabled") == 1
        settled(h)
    finally:
        h.close()


async def test_the_migration_is_a_span_holding_the_continuations_legs(tokenizer_dir, tok):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    h = make(tokenizer_dir, spans=spans)
    try:
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 40, "stream": True}
        prompt = prompt_ids(h, body, "completion")
        gen = tok.encode(TEXT, add_special_tokens=False).ids[:40]
        h.upstream.on(P, answer(completion("x", kv=KV)), answer(completion("x", kv=KV)))
        h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=6), greedy(tok, prompt, gen))
        assert (await h.send(body)).status == 200
        finished = {s.name: s for s in spans.get_finished_spans() if s.name != "decode"}
        decodes = [s for s in spans.get_finished_spans() if s.name == "decode"]
        server, migration = finished["POST /v1/completions"], finished["migration"]
        assert migration.parent.span_id == server.context.span_id
        attrs = migration.attributes
        assert attrs["pdgate.migration.reason"] == "disconnected" and attrs["pdgate.migration.path"] == "pd"
        assert attrs["pdgate.migration.to"] != attrs["pdgate.migration.from"]
        assert 0 < attrs["pdgate.migration.kept_tokens"] < 40
        first, second = sorted(decodes, key=lambda s: s.start_time)
        assert first.parent.span_id == server.context.span_id and not first.status.is_ok
        assert second.parent.span_id == migration.context.span_id  # the continuation's legs are inside
        assert server.attributes["pdgate.migrations"] == 1
    finally:
        h.close()


async def test_whole_answers_can_keep_their_engines_whole_answer(tokenizer_dir, tok):
    """routing.migration.non_streaming: false: a non-streamed request goes as sent (cheaper); its
    decode leg failing mid-answer is retried from the start on the other engine."""
    h = make(
        tokenizer_dir,
        routing={"decider": {"name": "token_threshold", "threshold": 64}, "migration": {"non_streaming": False}},
    )
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30}
        h.upstream.on(
            "decode", FakeResponse([b'{"choices": [{"text": "ha'], break_after=1), answer(completion("served whole"))
        )
        r = await h.send(body)
        assert r.status == 200 and r.json()["choices"][0]["text"] == "served whole"
        assert [c[2] for c in h.upstream.calls] == [body, body] and r.headers["x-pdgate-failover"] == "decode_retried"
        settled(h)
    finally:
        h.close()


@pytest.mark.parametrize(
    ("fields", "as_sent"),
    [
        ({"max_tokens": 64}, True),  # at most routing.migration.non_streaming_min_tokens (64)
        ({}, True),  # a completion's default: 16
        ({"max_tokens": 65}, False),
        ({"max_tokens": 10, "stream": True}, False),  # streams always migrate
    ],
)
async def test_a_short_whole_answer_goes_as_sent_and_a_failure_retries_it(tokenizer_dir, fields, as_sent):
    """By default a non-streamed request of a few tokens is not assembled from an engine stream
    (the gateway's CPU per token): a failure mid-answer regenerates it on the other engine."""
    h = make(tokenizer_dir, routing={"decider": {"name": "token_threshold", "threshold": 64}})
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", **fields}
        h.upstream.on(
            "decode", FakeResponse([b'{"choices": [{"text": "ha'], break_after=1), answer(completion("served whole"))
        )
        r = await h.send(body)
        sent = h.upstream.calls[0][2]
        assert (sent == body) is as_sent, sent
        if as_sent:
            assert r.status == 200 and r.json()["choices"][0]["text"] == "served whole"
            assert r.headers["x-pdgate-failover"] == "decode_retried"
        else:
            assert sent["return_token_ids"] is True and sent["stream"] is True
    finally:
        h.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_stream_broken_after_its_finish_reason_is_ended_by_the_gateway(h, tok, stream):
    """The engine died after the last token's event: nothing to migrate; the client gets the usage
    it asked for and [DONE] (or its whole answer), never a second finish."""
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 20, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:20]
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=20, usage=True))  # before usage, [DONE]
    r = await h.send(body)
    assert r.status == 200 and len(h.upstream.calls) == 1
    if stream:
        sent = [orjson.loads(e[6:]) for e in r.body.split(b"\n\n") if e.startswith(b"data: {")]
        assert [c["finish_reason"] for e in sent for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert sent[-1]["usage"] == {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + 20,
            "completion_tokens": 20,
        }
        assert r.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in r.body
    else:
        assert r.json()["choices"][0]["text"] == full_text(tok, prompt, gen)
    assert migrations(h, "ok") == migrations(h, "skipped") == 0
    settled(h)


async def test_a_continuation_waits_for_room_on_an_engine_at_its_limit(tokenizer_dir, tok):
    """admission.max_per_decode_endpoint: 1. The other decode engine is busy with another request:
    the continuation waits for it to finish rather than pile onto it."""
    h = make(tokenizer_dir, admission={"max_per_decode_endpoint": 1})
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True}
        prompt = prompt_ids(h, body, "completion")
        gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
        other = FakeResponse(
            events(tok, prompt, gen, kind="completion"), content_type=b"text/event-stream", hold_after=2
        )
        h.upstream.on("decode", other, breaking(tok, prompt, gen, "completion", after=6), greedy(tok, prompt, gen))
        busy = asyncio.create_task(h.send(body))  # holds one decode engine
        await until(lambda: len(h.upstream.calls) == 1)
        migrated = asyncio.create_task(h.send(body))
        await until(lambda: migrations(h, "ok") == 0 and len(h.upstream.calls) == 2)
        await asyncio.sleep(0.1)
        assert len(h.upstream.calls) == 2  # the continuation waits: the only other engine is full
        other.held.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(busy, migrated), 5)
        assert r1.status == r2.status == 200 and len(h.upstream.calls) == 3
        assert client_text(r2.body, "completion") == full_text(tok, prompt, gen)
        assert h.upstream.calls[2][0] == h.upstream.calls[0][0]  # on the engine the first request left
        settled(h)
    finally:
        h.close()
