"""The answer relayed to the client (gateway/request/answer_relay.py), driven through the real ASGI
endpoint against scripted engine legs: what the client receives, byte for byte or stitched, what
happens to the engine stream when the client leaves, and what the access log and metrics say the
client got."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from policies.base import LegOutcome
from tests.promtext import sample
from tests.waiting import until

from .exchange_harness import FakeResponse, stream
from .test_exchange import settled
from .test_exchange_migration import TEXT, prompt_ids
from .vllm_events import events, full_text

NOT_MIGRATABLE = {"logprobs": 1}  # its engine's events are relayed untouched


@pytest.mark.parametrize("fields", [{}, NOT_MIGRATABLE], ids=["stitched", "byte_for_byte"])
async def test_a_client_leaving_mid_stream_stops_the_engine_stream_and_the_record_says_so(h, fields):
    resp = stream("a", "b", "c", hold_after=1)  # the engine goes quiet after its first chunk
    h.upstream.on("decode", resp)
    leave = asyncio.Event()
    sent: list[dict] = []

    async def hang_up_after_first_chunk() -> None:
        await until(lambda: any(m.get("body") for m in sent))
        leave.set()

    hanger = asyncio.create_task(hang_up_after_first_chunk())
    body = {"model": "tiny", "prompt": "hello", "stream": True, **fields}
    await asyncio.wait_for(h.send(body, leave=leave, sent=sent), 5)
    await hanger
    assert resp.closed and not resp.released  # the connection dropped (vLLM aborts), never reused
    [leg] = h.recorder.legs()
    assert leg.outcome is LegOutcome.CUT
    [line] = h.access
    assert (line["status"], line["error"]) == (499, "client disconnected") and "error_status" not in line
    assert line["path"] == "direct" and "migrations" not in line  # a client leaving is no engine failure
    text = h.metrics.render().decode()
    assert sample(text, "pdgate_requests_total", model="tiny", path="direct", status="499") == 1
    settled(h)


async def test_an_unmigratable_stream_goes_byte_for_byte_and_is_counted(h):
    resp = stream("a", "b")
    h.upstream.on("decode", resp)
    r = await h.send({"model": "tiny", "prompt": "hello", "stream": True, **NOT_MIGRATABLE})
    assert r.status == 200 and r.body == b"".join(resp.chunks)
    assert r.headers["content-type"] == "text/event-stream" and r.headers["x-pdgate-path"] == "direct"
    assert r.headers["x-request-id"] and int(r.headers["x-pdgate-prompt-tokens"]) > 0
    assert resp.released  # a clean end: the engine connection goes back to the pool
    [line] = h.access
    assert line["status"] == 200 and line["output_tokens"] == 2 and "error" not in line  # one event per token
    assert line["ttft_ms"] is not None
    settled(h)


async def test_an_engine_breaking_off_after_done_has_sent_the_whole_answer(h):
    resp = stream("a", "b", break_after=3)  # a, b, [DONE], then the connection breaks
    h.upstream.on("decode", resp)
    r = await h.send({"model": "tiny", "prompt": "hello", "stream": True, **NOT_MIGRATABLE})
    assert r.status == 200 and r.body == b"".join(resp.chunks) and b'"error"' not in r.body
    [leg] = h.recorder.legs()
    assert leg.outcome is LegOutcome.OK
    assert not resp.released  # but its connection is not reused
    [line] = h.access
    assert line["status"] == 200 and "error" not in line and "migrations" not in line
    settled(h)


async def test_a_byte_for_byte_stream_broken_mid_answer_is_recorded_as_the_client_saw_it(h):
    h.upstream.on("decode", stream("a", "b", "c", break_after=2))
    r = await h.send({"model": "tiny", "prompt": "hello", "stream": True, **NOT_MIGRATABLE})
    sent = [e for e in r.body.split(b"\n\n") if e]
    assert r.status == 200 and sent[:2] == [b'data: {"choices":[{"text":"a"}]}', b'data: {"choices":[{"text":"b"}]}']
    assert orjson.loads(sent[2][6:])["error"]["code"] == "engine_error" and sent[3] == b"data: [DONE]"
    [line] = h.access
    assert (line["status"], line["error_status"], line["output_tokens"]) == (200, 502, 2)
    assert line["migrations"] == [{"reason": "disconnected", "result": "skipped", "why": "logprobs"}]
    assert h.recorder.events[-1][1].status == 502  # the policies learn that the answer failed
    settled(h)


async def test_a_client_that_did_not_stream_gets_its_engines_stream_as_one_answer(h, tok):
    body = {"model": "tiny", "prompt": "Write a handler.", "max_tokens": 12}
    prompt = prompt_ids(h, body, "completion")
    gen = tok.encode(TEXT, add_special_tokens=False).ids[:12]
    engine = events(tok, prompt, gen, kind="completion", usage=True)
    h.upstream.on("decode", FakeResponse(engine, content_type=b"text/event-stream"))
    r = await h.send(body)
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == full_text(tok, prompt, gen)
    assert out["choices"][0]["token_ids"] is None  # asked of the engine by the gateway, not by the client
    assert out["usage"]["completion_tokens"] == 12 and int(r.headers["content-length"]) == len(r.body)
    [line] = h.access
    assert (line["status"], line["output_tokens"], line["stream"]) == (200, 12, False)
    settled(h)


# -- a migratable stream spliced: the sink the engine connection's callback writes through ----------


class _Writer:
    def __init__(self) -> None:
        self.got: list[bytes] = []

    def write(self, data: bytes) -> bool:
        self.got.append(data)
        return True

    def drained(self, resume) -> None:
        resume()


class _Record:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def sent_chunk(self, chunk: bytes) -> None:
        self.chunks.append(chunk)


def _event(text: str, token: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": [token]}
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"


def test_the_stitched_sink_writes_what_the_answer_makes_and_stops_at_a_broken_event():
    from gateway.request.answer_relay import Outcome, _Stitched
    from gateway.request.stitch import Answer, Broken

    answer = Answer(
        "chat", stream=True, wants_ids=False, usage=False, continuous=False, prompt=[1, 2], max_event_bytes=1 << 16
    )
    writer, rec, outcome = _Writer(), _Record(), Outcome()
    sink = _Stitched(writer, answer, rec, outcome)  # type: ignore[arg-type]
    both = _event(" a", 7) + _event(" b", 8)[:20]  # one whole event and the start of the next
    assert sink.write(both) and not sink.stopped
    assert writer.got == rec.chunks and len(writer.got) == 1
    assert b'"token_ids":null' in writer.got[0] and b'" a"' in writer.got[0]  # as the engine sends without ids
    assert sink.write(_event(" b", 8)[20:] + b"data: {not json\n\n")
    assert sink.stopped  # the broken event stops the splice; what came before it went out
    assert b'" b"' in writer.got[-1] and list(answer.ids) == [7, 8]
    with pytest.raises(Broken):
        answer.check()
    assert not outcome.answered


def test_the_stitched_sink_marks_the_answer_whole_at_done():
    from gateway.request.answer_relay import Outcome, _Stitched
    from gateway.request.stitch import Answer

    answer = Answer(
        "chat", stream=True, wants_ids=False, usage=False, continuous=False, prompt=[1], max_event_bytes=1 << 16
    )
    writer, outcome = _Writer(), Outcome()
    sink = _Stitched(writer, answer, _Record(), outcome)  # type: ignore[arg-type]
    sink.write(_event(" a", 7, finish="stop") + b"data: [DONE]\n\n")
    assert outcome.answered and answer.done and not sink.stopped
    assert writer.got[-1].endswith(b"data: [DONE]\n\n")
