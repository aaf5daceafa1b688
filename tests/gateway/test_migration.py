"""Mid-stream migration's decisions (gateway/request/migration.py): which requests may continue elsewhere,
from which token, and as what request. The resume point is checked the way a client would notice
a mistake: a stream is cut at every point (with multi-byte characters split across tokens, and
with text held back for stop strings), continued from the resume point by an engine that
regenerates the same tokens, and the client's text must be the uninterrupted text, exactly."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer

from gateway.request.migration import continuation_body, output_budget, resume_point, unmigratable
from gateway.request.protocol import parse_body
from gateway.request.stitch import Answer, Broken, Diverged

from .vllm_events import client_text, events, full_text, texts


@pytest.fixture(scope="module")
def tiny(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from bench.decision_inputs import build_llama3_tokenizer

    return Tokenizer.from_file(str(build_llama3_tokenizer(tmp_path_factory.mktemp("llama3")) / "tokenizer.json"))


def req(kind: str, **body):
    base = (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        if kind == "chat"
        else {"model": "tiny", "prompt": "hi"}
    )
    return parse_body(orjson.dumps({**base, **body}), kind)  # type: ignore[arg-type]


# -- which requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "body", "why"),
    [
        ("chat", {}, None),
        ("completion", {"stop": ["\n"], "seed": 3, "temperature": 0.7}, None),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, None),
        ("chat", {"response_format": {"type": "text"}}, None),
        ("chat", {"response_format": {"type": "json_object"}}, "guided_decoding"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "guided_decoding",
        ),
        ("completion", {"structured_outputs": {"regex": "a+"}}, "guided_decoding"),
        ("chat", {"guided_json": {"type": "object"}}, "guided_decoding"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"n": 2}, "multiple_sequences"),
        ("completion", {"best_of": 2}, "multiple_sequences"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"logprobs": False}, None),
        ("completion", {"logprobs": 0}, "logprobs"),
        ("completion", {"prompt_logprobs": 1}, "logprobs"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"prompt": ["a", "b"]}, "batch_prompts"),
    ],
)
def test_what_may_migrate(kind, body, why):
    assert unmigratable(req(kind, **body), None) == why


def test_a_prompt_with_media_may_not_migrate():
    assert unmigratable(req("chat"), "multimodal") == "multimodal"
    assert unmigratable(req("chat"), "deepseek_v32") is None  # a renderer: the engine says its ids


# -- the continuation -------------------------------------------------------------------------------


def test_a_chat_continues_as_a_completion_of_its_prompt_and_output():
    chat = req(
        "chat",
        max_completion_tokens=100,
        min_tokens=30,
        temperature=0,
        seed=7,
        stop=["END"],
        stream=True,
        stream_options={"include_usage": True},
        tools=[],
        tool_choice="none",
        chat_template_kwargs={"x": 1},
        skip_special_tokens=False,
        cache_salt="s",
        vllm_xargs={"k": 1},
        logprobs=False,
        return_token_ids=False,
    )
    chat.body["priority"] = 3  # the gateway's, from the key's class: the continuation keeps it
    body = continuation_body(chat, [1, 2, 3, 9, 9], 2, max_model_len=4096, continuous=False)
    assert body == {
        "model": "tiny",
        "temperature": 0,
        "seed": 7,
        "stop": ["END"],
        "skip_special_tokens": False,
        "priority": 3,
        "cache_salt": "s",
        "vllm_xargs": {"k": 1},
        "prompt": [1, 2, 3, 9, 9],
        "max_tokens": 98,
        "min_tokens": 28,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "return_token_ids": True,
    }


@pytest.mark.parametrize(
    ("kind", "body", "budget"),
    [
        ("chat", {}, None),
        ("chat", {"max_tokens": 9}, 9),
        ("chat", {"max_tokens": 9, "max_completion_tokens": 5}, 5),
        # vLLM 0.32: a completions request's null max_tokens is its default, 16 (normalize_null_max_tokens)
        ("completion", {}, 16),
        ("completion", {"max_tokens": None}, 16),
        ("completion", {"max_tokens": 40}, 40),
    ],
)
def test_the_output_budget_is_vllms(kind, body, budget):
    r = req(kind, **body)
    assert output_budget(r) == budget
    out = continuation_body(r, [1, 2, 3], 4, max_model_len=100, continuous=True)
    # a chat request without a budget runs to the context's end: the continuation must say so
    assert out["max_tokens"] == (100 - 3 if budget is None else budget - 4)
    assert "min_tokens" not in out and out["stream_options"]["continuous_usage_stats"] is True


# -- where it resumes -------------------------------------------------------------------------------

TEXT = "def héllo(): return 'wörld 你好世界 🙂' # done\nclass X:\n    pass\n" * 3


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_resuming_where_the_text_sent_ends(name, request):
    tok: Tokenizer = request.getfixturevalue(name)
    prompt = tok.encode("Write some code:").ids
    gen = tok.encode(TEXT, add_special_tokens=False).ids
    deltas = texts(tok, prompt, gen)
    for k in range(len(gen) + 1):
        sent = "".join(deltas[:k])
        point = resume_point(tok, prompt, gen[:k], len(sent), sent[-100:])
        assert point is not None
        # the ids kept decode to exactly the text sent, and what follows them is only held-back bytes
        assert point.overlap == ""
        assert full_text(tok, prompt, gen[: point.tokens]) == sent
        assert all(d == "" for d in deltas[point.tokens : k])


def test_text_held_back_for_a_stop_string_is_reproduced_then_dropped(tiny):
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("alpha beta gamma delta epsilon", add_special_tokens=False).ids
    deltas = texts(tiny, prompt, gen, stop_buffer=4)  # stop=["ENDS"]: 3 characters held back
    k = len(gen) - 2
    sent = "".join(deltas[:k])
    point = resume_point(tiny, prompt, gen[:k], len(sent), sent)
    assert point is not None and point.tokens < k
    kept = full_text(tiny, prompt, gen[: point.tokens])
    assert kept + point.overlap == sent and sent.startswith(kept)


def test_the_continuation_generates_at_least_one_token(tiny):
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("one two three", add_special_tokens=False).ids
    sent = full_text(tiny, prompt, gen)
    point = resume_point(tiny, prompt, gen, len(sent), sent, max_tokens=len(gen))
    assert point is not None and point.tokens == len(gen) - 1
    assert point.overlap == texts(tiny, prompt, gen)[-1]  # the last token's text comes again, and is dropped


def test_text_the_tokens_do_not_make_is_no_resume_point(tiny):
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("one two three", add_special_tokens=False).ids
    assert resume_point(tiny, prompt, gen, 11, "one two xyz") is None  # text these tokens do not make
    assert resume_point(tiny, prompt, gen, 100, "x") is None  # more text than the tokens make


@pytest.mark.parametrize("name", ["tiny", "llama3"])
def test_priming_with_the_prompts_end_is_priming_with_all_of_it(name, request):
    """vLLM primes its detokenizer with the whole prompt; the replay with its last tokens."""
    from tokenizers.decoders import DecodeStream

    tok: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(5)
    for _ in range(20):
        prompt = tok.encode(TEXT[rng.randrange(len(TEXT)) :] * 3).ids
        gen = tok.encode(TEXT[rng.randrange(len(TEXT)) :], add_special_tokens=False).ids
        whole = DecodeStream(ids=prompt, skip_special_tokens=True)
        expected = "".join(whole.step(tok, t) or "" for t in gen)
        sent = full_text(tok, prompt[-64:], gen)
        assert sent == expected
        assert resume_point(tok, prompt, gen, len(sent), sent) is not None


# -- the whole round trip, as a client sees it --------------------------------------------------------


def feed(answer: Answer, data: bytes) -> bytes:
    """As the relay does: what the events make goes out, then a failure is raised."""
    out = answer.feed(data)
    answer.check()
    return out


def _cut_and_continue(tok, prompt, gen, cut, kind, stop_buffer, stream, wants_ids=False):
    """The client's answer when the engine dies after ``cut`` events and another engine continues
    greedily (so it regenerates the same tokens) from the resume point."""
    answer = Answer(
        kind, stream=stream, wants_ids=wants_ids, usage=stream, continuous=False, prompt=prompt, max_event_bytes=1 << 20
    )
    first = events(tok, prompt, gen, kind=kind, stop_buffer=stop_buffer, usage=True)
    out = b"".join(feed(answer, e) for e in first[:cut])
    assert not answer.done
    point = resume_point(tok, prompt, answer.ids, answer.text_len, answer.tail(answer.tail_chars), max_tokens=len(gen))
    assert point is not None
    answer.resume(point.tokens, point.overlap)
    kept = list(answer.ids)
    rest = events(
        tok,
        [*prompt, *kept],
        gen[len(kept) :],
        kind="completion",
        rid="r1-m1",
        created=2000,
        stop_buffer=stop_buffer,
        usage=True,
    )
    for e in rest:
        out += feed(answer, e)
    answer.ended()
    return answer, out


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stop_buffer", [0, 3])
def test_a_stream_cut_anywhere_reads_as_one_uninterrupted_stream(tiny, kind, stop_buffer):
    prompt = tiny.encode("Write some code:").ids
    gen = tiny.encode(TEXT[:120], add_special_tokens=False).ids
    expected = full_text(tiny, prompt, gen)
    for cut in range(1, len(gen) + (kind == "chat")):  # every event before the last token's
        answer, out = _cut_and_continue(tiny, prompt, gen, cut, kind, stop_buffer, stream=True)
        assert client_text(out, kind) == expected, cut
        assert list(answer.ids) == gen and answer.output_tokens == len(gen)
        sent = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
        assert {e["id"] for e in sent} == {f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-r1"}
        assert {e["created"] for e in sent} == {1000}
        assert {e["object"] for e in sent} == {"chat.completion.chunk" if kind == "chat" else "text_completion"}
        assert sum(1 for e in sent for c in e["choices"] if c["finish_reason"]) == 1
        assert all(c.get("token_ids") is None for e in sent for c in e["choices"])  # the client did not ask
        assert all(e.get("prompt_token_ids") is None for e in sent)
        [usage] = [e["usage"] for e in sent if not e["choices"]]
        assert usage == {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(gen),
            "completion_tokens": len(gen),
        }
        assert out.endswith(b"data: [DONE]\n\n") and out.count(b"[DONE]") == 1


def test_a_client_that_asked_for_token_ids_gets_each_once(tiny):
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("alpha beta gamma delta", add_special_tokens=False).ids
    for cut in range(2, len(gen)):
        _, out = _cut_and_continue(tiny, prompt, gen, cut, "completion", 4, stream=True, wants_ids=True)
        sent = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
        assert [t for e in sent for c in e["choices"] for t in c["token_ids"] or []] == gen
        assert [c["prompt_token_ids"] for e in sent for c in e["choices"] if c["prompt_token_ids"]] == [prompt]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_whole_answer_cut_mid_way_is_the_uninterrupted_answer(tiny, kind):
    prompt = tiny.encode("Write some code:").ids
    gen = tiny.encode(TEXT[:80], add_special_tokens=False).ids
    answer, out = _cut_and_continue(tiny, prompt, gen, len(gen) // 2, kind, 2, stream=False)
    assert out == b""  # nothing goes out before the end
    body = orjson.loads(answer.whole())
    text = body["choices"][0]["message"]["content"] if kind == "chat" else body["choices"][0]["text"]
    assert text == full_text(tiny, prompt, gen)
    assert body["id"] == f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-r1" and body["created"] == 1000
    assert body["usage"]["completion_tokens"] == len(gen) and body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_continuation_that_does_not_reproduce_the_text_sent_is_refused(tiny):
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("alpha beta gamma delta", add_special_tokens=False).ids
    answer = Answer(
        "completion",
        stream=True,
        wants_ids=False,
        usage=False,
        continuous=False,
        prompt=prompt,
        max_event_bytes=1 << 20,
    )
    for e in events(tiny, prompt, gen, kind="completion", stop_buffer=4)[:3]:
        answer.feed(e)
    point = resume_point(tiny, prompt, answer.ids, answer.text_len, answer.tail(answer.tail_chars))
    assert point is not None and point.overlap  # some held-back text must come again
    answer.resume(point.tokens, point.overlap)
    other = tiny.encode(" zzzz yyyy", add_special_tokens=False).ids  # sampling went elsewhere
    with pytest.raises(Diverged):
        for e in events(tiny, [*prompt, *answer.ids], other, kind="completion"):
            feed(answer, e)


def test_an_engine_error_event_breaks_the_stream(tiny):
    answer = Answer(
        "chat", stream=True, wants_ids=False, usage=False, continuous=False, prompt=[1], max_event_bytes=1 << 20
    )
    with pytest.raises(Broken) as err:
        feed(answer, b'data: {"error": {"message": "Internal server error", "code": 500}}\n\ndata: [DONE]\n\n')
    assert err.value.cause == "error_event"


def test_a_whole_answers_overlap_need_not_be_reproduced(tiny):
    """Nothing of a non-streamed answer went out: the continuation's text replaces the overlap,
    whatever sampling chose."""
    prompt = tiny.encode("Go:").ids
    gen = tiny.encode("alpha beta gamma delta", add_special_tokens=False).ids
    answer = Answer(
        "completion",
        stream=False,
        wants_ids=False,
        usage=False,
        continuous=False,
        prompt=prompt,
        max_event_bytes=1 << 20,
    )
    for e in events(tiny, prompt, gen, kind="completion", stop_buffer=4)[:3]:
        feed(answer, e)
    point = resume_point(tiny, prompt, answer.ids, answer.text_len, answer.tail(answer.tail_chars))
    assert point is not None and point.overlap
    answer.resume(point.tokens, point.overlap)
    other = tiny.encode(" zzzz yyyy", add_special_tokens=False).ids
    for e in events(tiny, [*prompt, *answer.ids], other, kind="completion"):
        feed(answer, e)
    text = orjson.loads(answer.whole())["choices"][0]["text"]
    assert text == full_text(tiny, prompt, gen[: point.tokens]) + full_text(
        tiny, [*prompt, *gen[: point.tokens]], other
    )


def test_a_continuation_ending_before_it_reproduced_the_overlap_diverged(tiny):
    answer = Answer(
        "completion", stream=True, wants_ids=False, usage=False, continuous=False, prompt=[1], max_event_bytes=1 << 20
    )
    feed(answer, events(tiny, [1], [300], kind="completion")[0])
    answer.resume(0, "and more text")
    with pytest.raises(Diverged):
        for e in events(tiny, [1], [300], kind="completion", finish="stop"):
            feed(answer, e)
