"""Mid-stream migration as a request lives it (gateway/request/migrator.py), driven through the real
ASGI endpoint against scripted decode engines that stream vLLM 0.32's events: what a migratable
request asks its engine for, a decode engine dying mid-stream continued on another with no token
twice and none lost, every failed engine avoided, the limits that stop a migration, and what the
access log and metrics say about each migration."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from gateway.request.migrator import whole_as_sent
from tests.promtext import sample

from .exchange_harness import D2, D, FakeResponse, make
from .test_exchange import settled
from .test_exchange_migration import TEXT, breaking, greedy, migrations, prompt_ids
from .vllm_events import client_text, full_text

D3 = "http://d3:1"
ROUTING: dict[str, Any] = {
    "decider": {"name": "token_threshold", "threshold": 64},
    "decode": {"scorers": [{"name": "prefix_affinity"}], "picker": {"name": "max_score"}},
    "prefix": {"block_size": 16},
}


def sent_ids(body: bytes) -> list[int]:
    """The generated token ids a client that asked for them (``return_token_ids``) was sent, in order."""
    ids: list[int] = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in orjson.loads(event[6:]).get("choices") or []:
                ids.extend(choice.get("token_ids") or [])
    return ids


@pytest.mark.parametrize(
    ("fields", "engine_gets"),
    [
        ({"stream": True}, {"stream": True, "return_token_ids": True}),
        ({}, {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}),
        ({"stream": True, "n": 2}, {"stream": True}),  # several sequences: not migratable, sent as it came
    ],
)
async def test_a_migratable_request_streams_its_token_ids_from_the_engine(h, fields, engine_gets):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}
    h.upstream.on("decode", FakeResponse([b"data: [DONE]\n\n"], content_type=b"text/event-stream"))
    await h.send(body)
    [(_, _, sent)] = h.upstream.calls
    assert sent == {**body, **engine_gets}


async def test_a_decode_engine_dying_mid_stream_continues_on_another_with_no_token_twice(h, tok):
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 40, "stream": True, "return_token_ids": True}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:40]
    h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=10), greedy(tok, prompt, gen))
    r = await h.send(body)
    assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in r.body
    assert client_text(r.body, "completion") == full_text(tok, prompt, gen)
    assert sent_ids(r.body) == gen  # every generated token once, in order: none twice, none lost
    (first, _, _), (second, _, continuation) = h.upstream.calls
    kept = len(continuation["prompt"]) - len(prompt)
    assert second != first and continuation["prompt"] == [*prompt, *gen[:kept]]
    [line] = h.access
    [m] = line["migrations"]
    assert (m["reason"], m["from"], m["to"], m["path"], m["tokens"], m["result"]) == (
        "disconnected",
        first,
        second,
        "direct",
        kept,
        "ok",
    )
    assert line["status"] == 200 and line["output_tokens"] == 40 and "error" not in line
    settled(h)


async def test_each_migration_avoids_every_engine_that_failed(tokenizer_dir, tok):
    h = make(
        tokenizer_dir,
        pools={"prefill": {"endpoints": ["http://p:1"]}, "decode": {"endpoints": [D, D2, D3]}},
        routing={**ROUTING, "migration": {"max_per_request": 2}},
    )
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 60, "stream": True}
        prompt = prompt_ids(h, body, "completion")
        gen = tok.encode(TEXT, add_special_tokens=False).ids[:60]

        def breaks_too(sent: dict) -> FakeResponse:
            resp = greedy(tok, prompt, gen)(sent)
            resp.break_after = 8
            return resp

        h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=8), breaks_too, greedy(tok, prompt, gen))
        r = await h.send(body)
        assert r.status == 200 and b'"error"' not in r.body
        assert client_text(r.body, "completion") == full_text(tok, prompt, gen)
        urls = [url for url, _, _ in h.upstream.calls]
        assert sorted(urls) == sorted([D, D2, D3])  # the third engine, not back to the first
        [line] = h.access
        assert [m["result"] for m in line["migrations"]] == ["failed", "ok"]
        assert [m["from"] for m in line["migrations"]] == urls[:2]
        assert migrations(h, "failed") == migrations(h, "ok") == 1
        settled(h)
    finally:
        h.close()


async def test_an_answer_past_the_migration_deadline_ends_with_the_error_event(tokenizer_dir, tok):
    h = make(tokenizer_dir, routing={**ROUTING, "migration": {"deadline_s": 1e-6}})
    try:
        body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 30, "stream": True}
        prompt = prompt_ids(h, body, "completion")
        gen = tok.encode(TEXT, add_special_tokens=False).ids[:30]
        h.upstream.on("decode", breaking(tok, prompt, gen, "completion", after=5))
        r = await h.send(body)
        sent = [e for e in r.body.split(b"\n\n") if e]
        assert orjson.loads(sent[-2][6:])["error"]["code"] == "engine_error" and sent[-1] == b"data: [DONE]"
        assert full_text(tok, prompt, gen).startswith(client_text(r.body, "completion"))
        assert len(h.upstream.calls) == 1
        [line] = h.access
        assert line["migrations"] == [{"reason": "disconnected", "result": "skipped", "why": "deadline"}]
        assert (line["status"], line["error_status"]) == (200, 502)
        assert sample(h.metrics.render().decode(), "pdgate_migrations_skipped_total", why="deadline") == 1
        settled(h)
    finally:
        h.close()


@pytest.mark.parametrize(
    ("kind", "fields", "bound", "why"),
    [
        ("chat", {"max_completion_tokens": 10, "max_tokens": 100}, 64, "short_answer"),  # vLLM reads the former
        ("chat", {"max_completion_tokens": 100, "max_tokens": 10}, 64, None),
        ("chat", {"max_tokens": 64}, 64, "short_answer"),
        ("chat", {}, 64, None),  # no bound: the context's room
        ("completion", {}, 64, "short_answer"),  # vLLM's default for completions: 16
        ("completion", {}, 15, None),
        ("completion", {"max_tokens": 1}, 0, None),  # 0: every non-streamed request migrates
    ],
)
def test_which_whole_answers_go_as_sent(kind, fields, bound, why):
    req = SimpleNamespace(kind=kind, body={"model": "tiny", **fields})
    assert whole_as_sent(req, True, bound) == why
    assert whole_as_sent(req, False, bound) == "non_streaming"
