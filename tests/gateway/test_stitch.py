"""Reading a migratable request's engine events (gateway/request/stitch.py): what the client receives must
be what the engine would have sent it. The streams in ``vllm_streams/`` are a real vLLM 0.32
engine's (the tiny test model, greedy), once with ``return_token_ids`` and once without."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.request.stitch import Answer, Broken

STREAMS = Path(__file__).parent / "vllm_streams"  # captured from vLLM 0.32.0 (see its README)

CHAT_WITH_IDS = (STREAMS / "chat-token-ids.sse").read_bytes()
CHAT_WITHOUT = (STREAMS / "chat.sse").read_bytes()
COMPLETION_WITH_IDS = (STREAMS / "completion-token-ids.sse").read_bytes()
COMPLETION_WITHOUT = (STREAMS / "completion.sse").read_bytes()
# The chat request answered whole by the engine (no stream).
CHAT_WHOLE = orjson.loads((STREAMS / "chat-whole.json").read_bytes())
CHAT_PROMPT = [1, 31, 95, 1516, 95, 33, 202, 285, 79, 337, 1418, 2, 202, 31, 95, 68, 323, 638, 857, 95, 33, 202]


def answer(
    kind: str = "chat",
    *,
    stream: bool = True,
    wants_ids: bool = False,
    prompt=CHAT_PROMPT,
    limit: int = 1 << 20,
    continuous: bool = False,
    shapes: bool = True,
) -> Answer:
    return Answer(
        kind,  # type: ignore[arg-type]
        stream=stream,
        wants_ids=wants_ids,
        usage=True,
        continuous=continuous,
        prompt=prompt,
        max_event_bytes=limit,
        shapes=shapes,
    )


def reads(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def _id(stream: bytes) -> bytes:
    return orjson.loads(stream.split(b"\n\n")[0][6:])["id"].encode()


@pytest.mark.parametrize("size", [7, 100, 100_000])  # events split across reads, several per read, all in one
@pytest.mark.parametrize(
    ("kind", "with_ids", "without", "prompt"),
    [
        ("chat", CHAT_WITH_IDS, CHAT_WITHOUT, CHAT_PROMPT),
        ("completion", COMPLETION_WITH_IDS, COMPLETION_WITHOUT, [285, 79, 337, 1418]),
    ],
)
def test_the_client_gets_the_bytes_the_engine_sends_without_token_ids(size, kind, with_ids, without, prompt):
    a = answer(kind, prompt=prompt)
    sent = b"".join(a.feed(chunk) for chunk in reads(with_ids, size))
    a.ended()
    assert sent == without.replace(_id(without), _id(with_ids))
    assert a.done and a.output_tokens == 4 and not a.prompt_mismatch and a.prompt_confirmed


def _reframed(stream: bytes, eol: bytes, keepalive: bool, fields: bool = False) -> bytes:
    """``stream`` as an HTTP hop in front of the engine may pass it on: ``eol`` line ends, a
    ``: keep-alive`` comment before every event, ``data:`` without its space; or (``fields``)
    vLLM's data lines followed by an ``id`` field and a comment."""
    events = [e for e in stream.split(b"\n\n") if e]
    out = []
    for i, e in enumerate(events):
        e = e + b"%sid: %d%s: t" % (eol, i, eol) if fields else e.replace(b"data: ", b"data:", 1)
        out.append((b": keep-alive" + eol + eol if keepalive else b"") + e + eol + eol)
    return b"".join(out)


@pytest.mark.parametrize("size", [1, 7, 100, 100_000])  # a CRLF split between reads included
@pytest.mark.parametrize(
    ("eol", "keepalive", "fields"),
    [
        (b"\r\n", False, False),
        (b"\r", False, False),
        (b"\n", True, False),
        (b"\r\n", True, False),
        (b"\n", False, True),
    ],
)
def test_line_ends_and_comments_a_proxy_adds_do_not_break_the_stream(size, eol, keepalive, fields):
    """vLLM frames events as ``data: ...`` and LF; another framing the SSE rules allow is read by
    those rules, not taken for a broken stream (which would migrate it or end it with an error)."""
    a = answer()
    sent = b"".join(a.feed(chunk) for chunk in reads(_reframed(CHAT_WITH_IDS, eol, keepalive, fields), size))
    a.check()
    a.ended()
    assert sent == CHAT_WITHOUT.replace(_id(CHAT_WITHOUT), _id(CHAT_WITH_IDS))  # vLLM's own framing
    assert a.done and a.output_tokens == 4 and a.prompt_confirmed


def test_an_event_whose_lines_end_otherwise_than_its_blank_line_is_read_whole():
    """A read of one event that ends in LF LF (the fast path's shape) whose own lines end in CR."""
    a = answer(wants_ids=True)
    events = [e for e in CHAT_WITH_IDS.split(b"\n\n") if e]
    sent = b"".join(a.feed(b": ping\r" + e + b"\rid: 1\n\n") for e in events)
    a.check()
    assert sent == CHAT_WITH_IDS and a.done


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_a_stream_relayed_raw_still_sees_its_done_in_another_framing(eol):
    a = answer("completion", prompt=[285, 79, 337, 1418])
    raw = COMPLETION_WITHOUT.replace(b"\n", eol)
    assert b"".join(a.feed(c) for c in reads(raw, 5)).replace(b"\r\n", b"\n") == COMPLETION_WITHOUT
    a.ended()
    assert a.unresumable == "no_token_ids" and a.done


def test_a_client_that_asked_for_token_ids_gets_the_engines_bytes():
    a = answer(wants_ids=True)
    assert b"".join(a.feed(c) for c in reads(CHAT_WITH_IDS, 64)) == CHAT_WITH_IDS


def test_a_whole_answer_is_the_one_the_engine_would_have_sent():
    a = answer(stream=False)
    assert a.feed(CHAT_WITH_IDS) == b""
    a.ended()
    first = orjson.loads(CHAT_WITH_IDS.split(b"\n\n")[0][6:])
    assert orjson.loads(a.whole()) == {**CHAT_WHOLE, "id": first["id"], "created": first["created"]}


def test_the_engines_prompt_ids_are_checked_against_the_gateways():
    a = answer(prompt=[1, 2, 3])
    a.feed(CHAT_WITH_IDS)
    assert a.prompt_mismatch and list(a.prompt()) == CHAT_PROMPT  # the continuation uses the engine's


@pytest.mark.parametrize("size", [7, 100, 100_000])
def test_tokens_without_ids_cannot_be_continued_and_go_through_untouched(size):
    """An engine that sends no token ids (vLLM before 0.10.2): nothing to continue from, so its
    bytes go to the client as they come, unread after the first token."""
    a = answer("completion", prompt=[285, 79, 337, 1418])
    assert b"".join(a.feed(c) for c in reads(COMPLETION_WITHOUT, size)) == COMPLETION_WITHOUT
    a.ended()
    assert a.unresumable == "no_token_ids" and a.done


def test_reasoning_deltas_cannot_be_continued_and_go_into_the_whole_answer():
    a = answer(stream=False)
    a.feed(
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
        b'"delta":{"reasoning":"hm","content":null},"logprobs":null,"finish_reason":null,"token_ids":[5]}]}\n\n'
    )
    assert a.unresumable == "parsed_output"


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (
            b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n',
            "error_event",
        ),
        (b"data: {not json\n\n", "bad_event"),
        (b"data: [1, 2]\n\n", "bad_event"),
    ],
)
def test_a_stream_that_fails_is_broken(raw, cause):
    a = answer()
    a.feed(CHAT_WITH_IDS.split(b"\n\n")[0] + b"\n\n")
    assert a.feed(raw) == b""
    with pytest.raises(Broken) as err:
        a.check()
    assert err.value.cause == cause


def test_events_before_a_failing_one_in_the_same_read_still_go_out():
    """A token event and an error event in one read: the token's text is the client's (and counted
    as sent), then the failure."""
    a = answer()
    events = CHAT_WITH_IDS.split(b"\n\n")
    error = b'data: {"error": {"message": "Internal server error", "code": 500}}'
    out = a.feed(b"\n\n".join([*events[:2], error, b"data: [DONE]"]) + b"\n\n")
    assert out.count(b"data: ") == 2 and b" IPv" in out and a.text_len == len(" IPv")
    with pytest.raises(Broken):
        a.check()
    a.check()  # raised once


def test_a_stream_that_ends_before_done_is_broken():
    a = answer()
    a.feed(b"\n\n".join(CHAT_WITH_IDS.split(b"\n\n")[:3]) + b"\n\n")
    with pytest.raises(Broken) as err:
        a.ended()
    assert err.value.cause == "ended"


def test_an_event_is_bounded():
    a = answer(limit=100)
    a.feed(b"data: {}\n\ndata: {")
    a.check()
    a.feed(b"x" * 200)
    with pytest.raises(Broken) as err:
        a.check()
    assert err.value.cause == "bad_event"


def test_an_event_over_the_bound_breaks_the_stream_after_the_whole_ones_before_it():
    """Raised inside the engine connection's callback (the splice), an oversized event used to
    end the read with a transport error logged as fatal and count as a disconnect: it is a
    failure like any broken event (``failure``), and the client still gets what came before it."""
    a = answer(limit=300)
    events = CHAT_WITH_IDS.split(b"\n\n")
    out = a.feed(b"\n\n".join(events[:2]) + b"\n\ndata: {" + b"x" * 400)
    assert out.count(b"data: ") == 2 and b" IPv" in out
    with pytest.raises(Broken) as err:
        a.check()
    assert err.value.cause == "bad_event"


def test_a_continuation_reads_as_the_client_answer():
    """A completions stream (the continuation) becomes chat deltas with the first part's id and
    creation time, usage for the original prompt and both parts, and without the text the client
    has already."""
    a = answer()
    events = CHAT_WITH_IDS.split(b"\n\n")
    a.feed(b"\n\n".join(events[:3]) + b"\n\n")  # role, " IPv", "****************"
    a.resume(1, "****************")  # kept " IPv"; the next token's text came before and comes again
    out = a.feed(COMPLETION_WITH_IDS.replace(b'"text":"thon"', b'"text":"****************"'))
    a.ended()
    sent = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["id"] for e in sent] == [_id(CHAT_WITH_IDS).decode()] * 3  # the reproduced text's event is dropped
    assert [c["delta"]["content"] for e in sent for c in e["choices"]] == ["open", "open", "open"]
    assert sent[-1]["choices"][0] == {
        "index": 0,
        "delta": {"content": "open"},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": None,
    }
    assert sent[-1]["system_fingerprint"] == "vllm-0.32.0-747d385c"
    assert a.output_tokens == 5 and list(a.ids) == [1337, 747, 1217, 1217, 1217]


def _with_continuous_usage(raw: bytes, prompt: int) -> bytes:
    """vLLM's stream_options.continuous_usage_stats: every event carries the usage so far."""
    out, n = [], 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            out += [event] if event else []
            continue
        obj = orjson.loads(event[6:])
        if obj.get("choices") and (obj["choices"][0].get("token_ids") or obj["choices"][0].get("text")):
            n += 1
        obj["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n}
        out.append(b"data: " + orjson.dumps(obj))
    return b"\n\n".join(out) + b"\n\n"


@pytest.mark.parametrize("continuous", [False, True])
def test_a_continuations_reproduced_text_is_dropped_with_continuous_usage_too(continuous):
    """The continuation's event that only reproduces text the client has says nothing new: with
    continuous usage it used to go out as an empty chunk repeating a count already sent."""
    a = answer(continuous=continuous)
    first = _with_continuous_usage(CHAT_WITH_IDS, len(CHAT_PROMPT)) if continuous else CHAT_WITH_IDS
    a.feed(b"\n\n".join(first.split(b"\n\n")[:3]) + b"\n\n")
    a.resume(1, "****************")
    rest = COMPLETION_WITH_IDS.replace(b'"text":"thon"', b'"text":"****************"')
    if continuous:
        rest = _with_continuous_usage(rest, len(CHAT_PROMPT) + 1)
    sent = [orjson.loads(e[6:]) for e in a.feed(rest).split(b"\n\n") if e.startswith(b"data: {")]
    contents = [c["delta"]["content"] for e in sent for c in e["choices"]]
    assert contents == ["open", "open", "open"]  # as without continuous usage: no empty repeat
    if continuous:
        counts = [e["usage"]["completion_tokens"] for e in sent]
        assert counts == sorted(set(counts))  # rising, never a count sent twice


_CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":%s%s}\n\n'
_NOT_OPENAI = [
    (b"[1]", b""),
    (b'["x"]', b""),
    (b"[[]]", b""),
    (b'"str"', b""),
    (b"5", b""),
    (b'{"a":1}', b""),
    (b'[{"delta":"str","text":"str"}]', b""),
    (b'[{"delta":["x"],"text":["x"]}]', b""),
    (b'[{"delta":{"content":5},"text":5,"token_ids":[9]}]', b""),
    (b'[{"delta":{"content":["x"]},"text":["x"],"token_ids":[9]}]', b""),
    (b'[{"delta":{"content":"a"},"text":"a","token_ids":[1.5]}]', b""),
    (b'[{"delta":{"content":"a"},"text":"a","token_ids":[8,null]}]', b""),
    (b'[{"delta":{"content":"a"},"text":"a","token_ids":[8,-1]}]', b""),
    (b"[]", b',"usage":5'),
    (b"[]", b',"usage":{"completion_tokens":"x","prompt_tokens_details":5}'),
    (b"[]", b',"prompt_token_ids":5'),
]


@pytest.mark.parametrize(("choices", "extra"), _NOT_OPENAI)
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("client_streams", [True, False])
@pytest.mark.parametrize("part", [0, 1])
def test_json_not_of_the_openai_shape_is_a_bad_event_that_records_nothing(choices, extra, kind, client_streams, part):
    """Whatever JSON an engine sends, the relay reads it or breaks the stream (a migration, or an
    error event); nothing else is raised, and a broken event leaves no id or text behind."""
    a = answer(kind, stream=client_streams, prompt=[1])
    good = b'[{"index":0,"delta":{"content":"a"},"text":"a","finish_reason":null,"token_ids":[7]}]'
    a.feed(_CHUNK % (good, b""))
    a.check()
    if part:
        a.resume(1, "")
    before = (a.ids.tolist(), a.text_len, a.tail(a.tail_chars))
    a.feed(_CHUNK % (choices, extra))
    try:
        a.check()
    except Broken as err:
        assert err.cause == "bad_event"
        assert (a.ids.tolist(), a.text_len, a.tail(a.tail_chars)) == before
        return
    last = b'[{"index":0,"delta":{"content":""},"text":"","finish_reason":"stop","token_ids":[2]}]'
    a.feed(_CHUNK % (last, b"") + b"data: [DONE]\n\n")
    a.check()
    a.ended()
    assert a.done and (a.whole() if not client_streams else a.close())


_DEEP = b"[" * 300 + b"]" * 300  # JSON orjson reads (1,024 levels) but cannot write (254)


@pytest.mark.parametrize(
    ("part", "bad"),
    [
        (0, b'[{"index":0,"text":"XYZ","logprobs":null,"finish_reason":null,"token_ids":[9],"x":%s}]' % _DEEP),
        (1, b'[{"index":0,"text":"XYZ","logprobs":null,"finish_reason":null,"token_ids":[9],"x":%s}]' % _DEEP),
        # a continuation's usage is rewritten (the first part's goes as the engine sent it)
        (1, b'[{"index":0,"text":"XYZ","logprobs":null,"finish_reason":null,"token_ids":[9]}],"usage":"bogus"'),
    ],
)
def test_an_event_that_cannot_be_sent_on_records_nothing_of_its_tokens(part, bad):
    """What goes to the client is made before the event's tokens are recorded: an event that fails
    there leaves no id or text behind, which a continuation would otherwise resume after."""
    a = answer("completion", prompt=[1])
    a.feed(_CHUNK % (b'[{"index":0,"text":"hi","logprobs":null,"finish_reason":null,"token_ids":[7]}]', b""))
    a.check()
    if part:
        a.resume(1, "")
    a.feed(_CHUNK % (bad, b""))
    with pytest.raises(Broken) as err:
        a.check()
    assert err.value.cause == "bad_event"
    assert (a.ids.tolist(), a.text_len, a.tail(a.tail_chars), a.finish) == ([7], 2, "hi", None)
