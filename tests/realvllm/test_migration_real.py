"""Mid-stream migration on real vLLM engines (issue 18): one prefill engine and two decode engines
(the package's pair plus a second decode engine started here, which serves the first part of each
answer directly and is then killed). The decode engine serving a stream is killed (SIGKILL) in
the middle of it; the stream finishes on the other decode engine, and the engines' own counters
say how the continuation got its context (the original prompt plus the tokens kept):

- when that context is long (over the P/D threshold), the prefill engine computed it and the
  surviving decode engine pulled all of it over NIXL, computing none of it;
- when it is short, the surviving decode engine computed it (no NIXL transfer).

Greedy decoding: the text the client reads equals an uninterrupted run's text, token for token
count. And a whole (non-streamed) answer the gateway assembles from the engine's stream equals the
engine's own non-streamed answer.

The second decode engine runs without the NixlConnector: it never pulls KV here, and three NIXL
progress threads busy-spinning on two cores starved transfers past vLLM's 30 s KV lease (seen).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.promtext import sample

from . import engines as E
from .conftest import Gateway, Pair, start_gateway
from .test_real_vllm import chat_messages

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

MAX_TOKENS = 1400  # the slowed engine's answer takes over 40 s: it dies mid-answer
KILL_AFTER = 20  # events the client reads before the (slowed) decode engine dies
STEP_S = 0.03  # what the victim's every step takes longer (enginesite/slowsteps.py)
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def second_decode(vllm_pair: Pair) -> Iterator[E.Engine]:
    """Another decode engine (no KV connector), on the prefill engine's core (the pair's decode
    engine keeps its own)."""
    venv, _ = E.venv_and_model()
    work = vllm_pair.group.log_dir
    slow_args, slow_env = E.slowable(work, "decode-2")
    eng = E.start_engine(
        vllm_pair.group,
        "decode-2",
        venv,
        vllm_pair.model_dir,
        work,
        vllm_pair.prefill.core,
        nixl=False,
        extra_args=["--enable-prompt-tokens-details", *slow_args],
        extra_env=slow_env,
    )
    try:
        E.wait_ready([eng])
        E.pin_engine(eng)
        yield eng
    finally:
        eng.proc.stop()
        eng.http.close()


def gateway(pair: Pair, second: E.Engine, name: str, threshold: int) -> Gateway:
    """Decode pool [second, pair's decode]; no scorers, so a fresh gateway's first request goes to
    the first of them (ties rotate from the first) and a continuation to the other."""
    return start_gateway(
        pair,
        name,
        pools={"prefill": {"endpoints": [pair.prefill.url]}, "decode": {"endpoints": [second.url, pair.decode.url]}},
        routing={
            "decider": {"name": "token_threshold", "threshold": threshold},
            "prefix": {"enabled": False},
            "decode": {"filters": [], "scorers": []},
        },
        health={"interval_s": 0.5, "timeout_s": 2.0},
    )


def by_source(eng: E.Engine) -> dict[str, float]:
    text = eng.metrics()
    return {
        s: sample(text, E.PROMPT_BY_SOURCE, source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    } | {"xfers": sample(text, E.XFER_COUNT), "failed": sample(text, E.XFER_FAILED)}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def access_line(gw: Gateway, rid: str) -> dict:
    found: list[dict] = []

    def look() -> bool:
        for line in gw.proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"request_id":"{rid}"' in line:
                found.append(json.loads(line))
                return True
        return False

    assert E.wait_until(look, timeout=10), gw.proc.log_tail()
    return found[0]


def stream_and_kill(gw: Gateway, messages: list[dict], rid: str, victim: E.Engine) -> tuple[list, dict]:
    """The engine's own uninterrupted answer (greedy); then the same request through the gateway,
    the engine slowed down (each step STEP_S longer) and SIGKILLed once the client has read
    KILL_AFTER events: in the middle of its answer, whatever this machine's load. (Unslowed, the
    engine could be done long before a gateway starved of CPU by the engines had relayed much.)"""
    reference = uninterrupted(victim, messages)
    body = {
        "model": E.MODEL_NAME,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    events: list = []
    with (
        E.slowed(victim, STEP_S),
        httpx.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json=body,
            headers={"x-request-id": rid},
            timeout=E.REQUEST_TIMEOUT_S,
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if len(events) == KILL_AFTER:
                    E.kill(victim)
    assert victim.proc.popen.poll() is not None, "the engine was not killed"
    return events, reference


def text_of(events: list) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in events if isinstance(e, dict) for c in e.get("choices") or []
    )


def uninterrupted(eng: E.Engine, messages: list[dict]) -> dict:
    r = eng.http.post(eng.url + "/v1/chat/completions", json={"model": E.MODEL_NAME, "messages": messages, **GREEDY})
    r.raise_for_status()
    return r.json()


def check_whole_stream(events: list, reference: dict, rid: str) -> None:
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in e for e in chunks), chunks[-3:]
    assert {e["id"] for e in chunks} == {f"chatcmpl-{rid}"}
    got, want = text_of(chunks), reference["choices"][0]["message"]["content"]
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    cut = len(text_of(chunks[:KILL_AFTER]))  # about where the first part ended
    assert got == want, (
        f"joined text differs at char {at} (the cut near {cut}): "
        f"{got[max(0, at - 20) : at + 20]!r} != {want[max(0, at - 20) : at + 20]!r}"
    )
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]


def test_a_whole_answer_is_the_engines_own(vllm_pair: Pair, second_decode: E.Engine):
    """A migratable request that is not streamed streams from its engine; the gateway's answer is
    the one the engine gives when asked for a whole answer."""
    gw = gateway(vllm_pair, second_decode, "gateway-migration-whole", threshold=100_000)
    try:
        messages = chat_messages(vllm_pair, 200)
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": E.MODEL_NAME, "messages": messages, **GREEDY},
            headers={"x-request-id": "whole-1"},
            timeout=E.REQUEST_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        served = access_line(gw, "whole-1")["decode"]
        eng = second_decode if served == second_decode.url else vllm_pair.decode
        own = uninterrupted(eng, messages)
        got = r.json()
        for body in (got, own):  # the second run hits what the first cached; the rest must agree
            body["usage"]["prompt_tokens_details"].update(cached_tokens=None, created_cache_tokens=None)
        assert got == {**own, "id": "chatcmpl-whole-1", "created": got["created"]}
    finally:
        gw.proc.stop()


def test_a_continuation_with_a_long_context_is_pulled_over_nixl(vllm_pair: Pair, second_decode: E.Engine):
    """The prompt (500 tokens) goes direct; with the tokens kept, the continuation's context is over
    the threshold (512): the prefill engine computes it and the survivor pulls it."""
    gw = gateway(vllm_pair, second_decode, "gateway-migration-pd", threshold=512)
    try:
        messages = chat_messages(vllm_pair, 500)
        survivor, prefill = vllm_pair.decode, vllm_pair.prefill
        # The first part runs on the second decode engine alone: these counters move for the continuation.
        before = {"decode": by_source(survivor), "prefill": by_source(prefill)}
        events, reference = stream_and_kill(gw, messages, "migrate-pd", second_decode)
        line = access_line(gw, "migrate-pd")
        [m] = line["migrations"]
        assert line["path"] == "direct"  # the request's own path
        assert (m["result"], m["from"], m["to"], m["path"]) == ("ok", second_decode.url, survivor.url, "pd"), m
        kept = m["tokens"]
        assert 0 < kept < MAX_TOKENS
        context = 500 + kept
        d: dict[str, float] = {}
        assert E.wait_until(lambda: (d.update(delta(by_source(survivor), before["decode"])) or d)["xfers"] == 1), d
        assert (d["external_kv_transfer"], d["local_compute"], d["failed"]) == (context, 0, 0), d
        p = delta(by_source(prefill), before["prefill"])
        assert p["local_compute"] + p["local_cache_hit"] == context, p  # the prefill engine did it
        check_whole_stream(events, reference, "migrate-pd")
    finally:
        gw.proc.stop()
        E.restart(second_decode)  # for the next test, on the same port


def test_a_stream_on_the_direct_path_continues_computed_by_the_other_engine(vllm_pair: Pair, second_decode: E.Engine):
    gw = gateway(vllm_pair, second_decode, "gateway-migration-direct", threshold=100_000)
    try:
        messages = chat_messages(vllm_pair, 300)
        survivor = vllm_pair.decode
        before = by_source(survivor)
        events, reference = stream_and_kill(gw, messages, "migrate-direct", second_decode)
        [m] = access_line(gw, "migrate-direct")["migrations"]
        assert (m["result"], m["to"], m["path"]) == ("ok", survivor.url, "direct"), m
        d: dict[str, float] = {}
        assert E.wait_until(lambda: (d.update(delta(by_source(survivor), before)) or d)["local_compute"] > 0), d
        assert d["local_compute"] + d["local_cache_hit"] == 300 + m["tokens"]
        assert (d["xfers"], d["external_kv_transfer"]) == (0, 0), d  # no KV moved
        check_whole_stream(events, reference, "migrate-direct")
    finally:
        gw.proc.stop()
