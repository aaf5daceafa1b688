"""Token events read by their shape (gateway/request/token_shape.py) against the parsed path
(gateway/request/stitch.py with ``shapes=False``), the reference: for real vLLM 0.32 streams
with every kind of text, read in every split, both give the client the same bytes and leave the
same record (ids, text, finish, usage, whole answer), and fail the same way."""

from __future__ import annotations

import json
import random
from pathlib import Path

import orjson
import pytest

from gateway.request.stitch import Answer, Broken, Diverged
from gateway.request.token_shape import TokenShape
from tests.gateway.test_stitch import answer as stitched

STREAMS = Path(__file__).parent / "vllm_streams"  # captured from vLLM 0.32.0 (see its README)
CHAT = (STREAMS / "chat-token-ids.sse").read_bytes()
COMPLETION = (STREAMS / "completion-token-ids.sse").read_bytes()
PROMPTS = {"chat": [1, 31, 95, 1516, 95, 33, 202, 285, 79, 337, 1418, 2, 202, 31, 95, 68, 323, 638, 857, 95, 33, 202]}
PROMPTS["completion"] = [285, 79, 337, 1418]
CAPTURED = {"chat": CHAT, "completion": COMPLETION}

TEXTS = [" IPv", "", "héllo", "日本語のテキスト", "🙂", 'say "hi"', "back\\slash", "line\nbreak"]
TEXTS += ["\t", "\x01", "\u2028", "/"]


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def _token_event(kind: str, template: dict, text: str, ids: list[int]) -> bytes:
    choice = dict(template["choices"][0])
    if kind == "chat":
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
        choice["prompt_token_ids"] = None
    choice["token_ids"] = ids
    return b"data: " + orjson.dumps({**template, "choices": [choice]})


def stream(kind: str, texts: list[str], ids: list[list[int]] | None = None) -> bytes:
    """The captured stream of ``kind`` with its token events made of ``texts`` (and ``ids``)."""
    events = _events(CAPTURED[kind])
    first = 1 if kind == "chat" else 0  # the chat role chunk; completions' first event carries the prompt ids
    template = orjson.loads(events[first + 1][6:])
    made = [_token_event(kind, template, t, (ids or [])[i] if ids else [100 + i]) for i, t in enumerate(texts)]
    return b"".join(e + b"\n\n" for e in events[: first + 1] + made + events[-3:])


def answer(kind: str, shapes: bool, *, stream: bool = True, wants_ids: bool = False) -> Answer:
    return stitched(kind, stream=stream, wants_ids=wants_ids, prompt=PROMPTS[kind], shapes=shapes)


def run(a: Answer, reads: list[bytes]) -> tuple[list[bytes], str | None]:
    out, failure = [], None
    for chunk in reads:
        out.append(a.feed(chunk))
        try:
            a.check()
        except (Broken, Diverged) as err:
            failure = f"{type(err).__name__}:{getattr(err, 'cause', '')}"
            break
    return out, failure


def record(a: Answer) -> tuple:
    return (
        a.ids.tolist(),
        a.tail(a.tail_chars),
        a.text_len,
        a.finish,
        a.done,
        a.unresumable,
        a.prompt_tokens,
        a.cached_tokens,
        a.whole() if not a.stream else b"",
    )


def split(raw: bytes, size: int | str) -> list[bytes]:
    if size == "event":
        return [e + b"\n\n" for e in _events(raw)]
    return [raw[i : i + size] for i in range(0, len(raw), size)]  # type: ignore[misc]


def same(kind: str, raw: bytes, size: int | str, **how: bool) -> Answer:
    fast, ref = answer(kind, True, **how), answer(kind, False, **how)
    reads = split(raw, size)
    assert run(fast, reads) == run(ref, reads)
    assert record(fast) == record(ref)
    return fast


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("size", [1, 7, 100, "event", 1 << 20])  # an event per read is the usual case
@pytest.mark.parametrize(("client_streams", "wants_ids"), [(True, False), (True, True), (False, False), (False, True)])
def test_every_text_gives_what_the_parsed_path_gives(kind, size, client_streams, wants_ids):
    raw = stream(kind, TEXTS * 3)
    same(kind, raw, size, stream=client_streams, wants_ids=wants_ids)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_captured_streams_read_the_same(kind):
    for size in (1, 7, 100, "event", 1 << 20):
        same(kind, CAPTURED[kind], size)


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_ids_and_splits_read_the_same(seed):
    rng = random.Random(seed)
    alphabet = ["a", " ", "é", "日", "🙂", '"', "\\", "\n", "\x00", "\x1f", "\x7f", "0", "]", "}", ","]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 40))]
    ids = [[rng.choice([0, 7, 10, 128000, 4294967295])] * rng.choice([1, 1, 1, 2, 0]) for _ in texts]
    kind = rng.choice(["chat", "completion"])
    raw = stream(kind, texts, ids)
    sizes = [rng.randint(1, 400) for _ in range(4)]
    reads, i = [], 0
    while i < len(raw):
        n = rng.choice(sizes)
        reads.append(raw[i : i + n])
        i += n
    client_streams = rng.random() < 0.8
    fast, ref = answer(kind, True, stream=client_streams), answer(kind, False, stream=client_streams)
    assert run(fast, reads) == run(ref, reads)
    assert record(fast) == record(ref)


def test_plain_token_events_are_not_parsed(monkeypatch):
    parsed = []
    payload = Answer._payload
    monkeypatch.setattr(Answer, "_payload", lambda self, p: parsed.append(p) or payload(self, p))
    raw = stream("chat", ["a", "b", "c", "日本", 'q"uote', "d"] * 10)
    run(answer("chat", True), split(raw, "event"))
    # parsed: the role chunk, the first token event (its shape learnt), the ten quoted ones,
    # the finish, the usage chunk and [DONE]
    assert len(parsed) == 1 + 1 + 10 + 3


def _bytes_stream(kind: str, body: bytes) -> bytes:
    """A stream whose second token event's text is ``body`` as it stands (not valid JSON text perhaps)."""
    raw = stream(kind, ["aa", "XXXX", "bb"])
    return raw.replace(b'"XXXX"', b'"' + body + b'"', 1)


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe", b"\xed\xa0\x80", b"caf\xc3", b"tab\there", b"new\nline", b"nul\x00", b"a\\", b'a\\"b'],
)
@pytest.mark.parametrize("size", [1, "event", 1 << 20])
def test_what_is_not_json_text_fails_as_the_parsed_path_fails(body, size):
    raw = _bytes_stream("chat", body)
    fast, ref = answer("chat", True), answer("chat", False)
    reads = split(raw, size)
    got = run(fast, reads)
    assert got == run(ref, reads)
    assert record(fast) == record(ref)
    assert got[1] == (None if body == b'a\\"b' else "Broken:bad_event")  # a\"b is the JSON text a"b


@pytest.mark.parametrize(
    "event",
    [
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[01]}',
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[-1]}',
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[1,2]}',
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[]}',
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[1e3]}',
        b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":"stop","token_ids":[1]}',
        b'{"index":0,"delta":{"content":"x", "x":1},"logprobs":null,"finish_reason":null,"token_ids":[1]}',
        b'{"index":0,"delta":{"content":"x\\u0041"},"logprobs":null,"finish_reason":null,"token_ids":[1]}',
    ],
)
def test_the_reader_takes_only_the_exact_shape(event):
    shape = _learnt()
    head = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":['
    raw = head + event + b"]}"
    assert shape.read(raw, len(raw)) is None
    good = head + b'{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,"token_ids":[12]}]}'
    text, token, cut = shape.read(good, len(good))  # type: ignore[misc]
    assert (text, token) == ("x", 12) and good[:cut] + shape.stripped == good.replace(b"[12]", b"null") + b"\n\n"
    other = good.replace(b'"c1"', b'"c2"')  # another stream's event
    assert shape.read(other, len(other)) is None
    usage = good[:-1] + b',"usage":{"prompt_tokens":1}}'
    assert shape.read(usage, len(usage)) is None


BASE = (
    b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"y"},"logprobs":null,"finish_reason":null,"token_ids":[5]}]}'
)


def _learnt() -> TokenShape:
    shape = TokenShape.learn("chat", orjson.loads(BASE), BASE)
    assert shape is not None
    return shape


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(orjson.loads(BASE)).encode(),  # spaces: the engine does not serialise as orjson does
        BASE.replace(b'{"content":"y"}', b'{"content":"y","reasoning":"r"}'),  # a reasoning delta
        BASE[:-1] + b',"usage":{"prompt_tokens":3}}',  # usage on every event
        BASE.replace(b"[5]", b"[5,6]"),  # several ids
        BASE.replace(b"[5]", b"null"),  # none
        BASE.replace(b'"finish_reason":null', b'"finish_reason":"stop"'),
        BASE[:-1] + b',"prompt_token_ids":[1]}',
        BASE.replace(b'"c1"', '"\ue000pdgate-text\ue001"'.encode()),  # the marker itself in the head
    ],
)
def test_no_shape_is_learnt_from_an_event_it_cannot_stand_for(raw):
    assert TokenShape.learn("chat", orjson.loads(raw), raw) is None


def test_a_continuation_is_read_by_the_parsed_path():
    """After a migration the events are rewritten as the client's: the first part's shape is
    dropped and the continuation reads as it did."""
    raw = stream("chat", ["one", " two", " three"])
    head = raw[: raw.rindex(b"\n\n", 0, raw.index(b" three")) + 2]  # the events before " three"
    cont = split(stream("completion", [" three", "!"]), "event")
    results = []
    for shapes in (True, False):
        a = answer("chat", shapes)
        a.feed(head)
        learnt = a._shape is not None
        a.resume(2, "")
        results.append((learnt, a._shape, run(a, cont), record(a)))
    assert results[0][0] and not results[1][0]
    assert results[0][1:] == results[1][1:]


def test_a_token_after_the_finish_breaks_the_stream_on_both_paths():
    raw = stream("chat", ["a", "b"])
    events = split(raw, "event")
    assert b'"finish_reason":"length"' in events[4]
    reads = [*events[:5], events[3]]  # "b", again, after the finish reason
    fast, ref = answer("chat", True), answer("chat", False)
    assert run(fast, reads) == run(ref, reads)
    assert run(answer("chat", True), reads)[1] == "Broken:bad_event"


@pytest.mark.parametrize("held", [b"data: {", b'data: {"id":1}\r'])
def test_a_read_after_held_bytes_is_not_taken_for_a_whole_event(held):
    """Bytes held of an event (or a CR that may start a CRLF) make the next read part of it."""
    events = split(stream("chat", ["a", "b", "c"]), "event")
    reads = [*events[:3], held, events[3], *events[4:]]
    fast, ref = answer("chat", True), answer("chat", False)
    assert run(fast, reads) == run(ref, reads)
    assert record(fast) == record(ref)


@pytest.mark.parametrize("field", [b"system_fingerprint", b"metrics"])
@pytest.mark.parametrize("client_streams", [True, False])
def test_a_field_the_answer_keeps_is_not_skipped_by_the_shape(field, client_streams):
    """Events with a fingerprint (or metrics) are parsed: read by their shape, an event equal to
    an earlier one but for a parsed event between them would not set it back."""
    ev = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":"%s"},"logprobs":null,"finish_reason":%s,"token_ids":[%s]}],"%s":"%s"}\n\n'
    )
    reads = [
        ev % (b"a", b"null", b"1", field, b"A"),
        ev % (b"b\\n", b"null", b"2", field, b"B"),  # an escape: parsed
        ev % (b"c", b"null", b"3", field, b"A"),
        ev % (b"", b'"stop"', b"4", field, b"A"),
        b"data: [DONE]\n\n",
    ]
    fast, ref = answer("chat", True, stream=client_streams), answer("chat", False, stream=client_streams)
    assert run(fast, reads) == run(ref, reads)
    assert record(fast) == record(ref) and fast._shape is None
    fast, ref = answer("chat", True, stream=True), answer("chat", False, stream=True)
    run(fast, reads[:3]), run(ref, reads[:3])
    assert fast.close() == ref.close()


def test_no_shape_is_learnt_when_the_ids_come_before_the_text():
    raw = BASE.replace(b'"delta":{"content":"y"},"logprobs":null,', b"").replace(
        b'"token_ids":[5]', b'"token_ids":[5],"delta":{"content":"y"},"logprobs":null'
    )
    assert orjson.loads(raw)["choices"][0]["delta"] == {"content": "y"}
    assert TokenShape.learn("chat", orjson.loads(raw), raw) is None


@pytest.mark.parametrize("token", [b"4294967296", b"18446744073709551616", b"1.5", b"-1", b"999999999"])
@pytest.mark.parametrize("size", ["event", 1 << 20])
def test_a_token_id_no_token_can_have_breaks_the_stream_on_both_paths(token, size):
    """An id past 2**32 (or a float, a negative) is a bad event, not an error in the relay; the
    ids before it are kept as they were, for a continuation."""
    raw = stream("chat", ["a", "b", "c"]).replace(b"[101]", b"[" + token + b"]")
    fast, ref = answer("chat", True), answer("chat", False)
    reads = split(raw, size)
    got = run(fast, reads)
    assert got == run(ref, reads) and record(fast) == record(ref)
    if token == b"999999999":
        assert got[1] is None and 999999999 in fast.ids
    else:
        assert got[1] == "Broken:bad_event" and fast.ids.tolist() == [1337, 100]
