"""Routing beliefs checked against real vLLM engines (issue 12), through a gateway that routes on
what it learned from requests (no KV event feed), as a user meets them:

- a conversation's second turn goes direct onto a real cache hit: the decode engine's own
  counters show the cached part served from its prefix cache and only the new tokens computed;
- a request the engine refuses is not learned: the same prompt later still takes the P/D path;
- a client hanging up mid-stream stops the engine's work;
- the threshold reloaded while requests flow applies to the next request, and none fails;
- a decode engine killed mid-stream ends the stream with an error event then ``[DONE]``; restarted,
  its empty cache is not believed full: the next turn takes the P/D path (a real NIXL transfer,
  nothing prefilled on the decode engine);
- a decode engine running without prefix caching never gets a turn as "cached".

Which path a request took is proven from the engines' counters, as in ``test_real_vllm.py``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.promtext import sample

from . import engines as E
from .conftest import THRESHOLD, Gateway, Pair, start_gateway
from .test_real_vllm import chat_messages, counters, expect_pd

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

TOKEN = "realvllm-beliefs-admin"
SAMPLING = {"max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def gw(vllm_pair: Pair) -> Iterator[Gateway]:
    token_file = vllm_pair.group.log_dir / "beliefs-admin-token"
    token_file.write_text(TOKEN)
    gw = start_gateway(
        vllm_pair,
        "gateway-beliefs",
        routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}},  # prefix index on, learned only
        admin={"token_file": str(token_file)},
        health={"interval_s": 0.5, "timeout_s": 2.0},
        signals={"scrape_interval_s": 0.5, "scrape_timeout_s": 2.0, "max_age_s": 5.0},
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def chat(gw: Gateway, messages: list[dict], **kw) -> httpx.Response:
    body = {"model": E.MODEL_NAME, "messages": messages, **SAMPLING, **kw}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S)


def plan(gw: Gateway, messages: list[dict]) -> dict:
    r = httpx.post(
        gw.url + "/debug/route",
        json={"model": E.MODEL_NAME, "messages": messages},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def next_turn(messages: list[dict], reply: httpx.Response) -> list[dict]:
    said = reply.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": "Go on, please."}]


def by_source(eng: E.Engine, name: str) -> float:
    return eng.metric(E.PROMPT_BY_SOURCE, source=name)


def gateway_metric(gw: Gateway, name: str, **labels: str) -> float:
    return sample(httpx.get(gw.url + "/metrics", timeout=10).text, name, **labels)


def first_turn(pair: Pair, gw: Gateway, tokens: int = 1500) -> tuple[list[dict], httpx.Response]:
    """A new conversation's first turn: long and new to every engine, so P/D."""
    messages = chat_messages(pair, tokens)
    before = counters(pair, gw)
    r = chat(gw, messages)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "pd"
    expect_pd(pair, gw, before, tokens)
    return messages, r


def second_turn_is_pd(pair: Pair, gw: Gateway, messages: list[dict]) -> None:
    """The next turn takes the P/D path, and the decode engine prefills none of it itself."""
    n = pair.decode.tokenize_chat(messages)
    assert plan(gw, messages)["path"] == "pd", plan(gw, messages)
    before = counters(pair, gw)
    r = chat(gw, messages)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "pd"
    expect_pd(pair, gw, before, n)


def restarts(gw: Gateway) -> float:
    return gateway_metric(gw, "pdgate_endpoint_restarts_total", pool="decode")


def wait_decode_back(pair: Pair, gw: Gateway, restarts_before: float) -> None:
    """The gateway sees the decode engine healthy again and knows it is a new run."""
    ok = E.wait_until(
        lambda: (
            httpx.get(gw.url + "/ready", timeout=5).json()["pools"]["decode"]["healthy"] == 1
            and restarts(gw) > restarts_before
        ),
        timeout=60,
    )
    assert ok, f"the gateway never saw the restarted decode engine:\n{gw.proc.log_tail()}"


def test_turn_two_goes_direct_on_a_real_cache_hit(vllm_pair: Pair, gw: Gateway) -> None:
    d = vllm_pair.decode
    messages, r1 = first_turn(vllm_pair, gw)
    turn2 = next_turn(messages, r1)
    n2 = d.tokenize_chat(turn2)
    seen = plan(gw, turn2)
    cached = seen["cached_tokens"][d.url]
    assert (seen["path"], seen["reason"]) == ("direct", "prefix_cached") and n2 - cached < THRESHOLD
    hits, local, xfers = by_source(d, "local_cache_hit"), by_source(d, "local_compute"), d.metric(E.XFER_COUNT)
    exact = gateway_metric(gw, "pdgate_prefix_belief_checks_total", pool="decode", result="exact")
    r2 = chat(gw, turn2)
    assert r2.status_code == 200 and r2.headers["x-pdgate-path"] == "direct"
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached  # the engine's own word
    assert E.wait_until(lambda: by_source(d, "local_cache_hit") == hits + cached), "no cache hit on the engine"
    assert by_source(d, "local_compute") == local + n2 - cached  # only the new tokens computed
    assert d.metric(E.XFER_COUNT) == xfers
    assert E.wait_until(
        lambda: gateway_metric(gw, "pdgate_prefix_belief_checks_total", pool="decode", result="exact") == exact + 1
    )


def test_a_request_the_engine_refuses_is_not_learned(vllm_pair: Pair, gw: Gateway) -> None:
    messages = chat_messages(vllm_pair, 1500)
    r = chat(gw, messages, logprobs=True, top_logprobs=100)  # vLLM allows at most 20
    assert r.status_code == 400, r.text
    assert "logprobs" in r.json()["error"]["message"]
    assert vllm_pair.decode.url not in plan(gw, messages)["cached_tokens"]
    second_turn_is_pd(vllm_pair, gw, messages)  # the same prompt: still long and uncached


def test_a_client_hanging_up_mid_stream_stops_the_engine(vllm_pair: Pair, gw: Gateway) -> None:
    d = vllm_pair.decode
    max_tokens = 1900  # minutes of decoding for this engine: only an abort ends it within the test

    def generated() -> float:
        return d.metric("vllm:generation_tokens_total")

    before = generated()
    body = {
        "model": E.MODEL_NAME,
        "messages": chat_messages(vllm_pair, 60),
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    # The stream is closed: the gateway drops the engine connection, and vLLM aborts the request:
    # its token count stops growing, far short of max_tokens.
    last = [generated()]

    def stopped() -> bool:
        now = generated()
        same, last[0] = now == last[0], now
        return same and d.metric("vllm:num_requests_running") == 0

    assert E.wait_until(stopped, timeout=30, interval=2.0)
    assert 0 < generated() - before < max_tokens / 2
    assert E.wait_until(lambda: gateway_metric(gw, "pdgate_pool_in_flight_requests", pool="decode") == 0)


def test_a_reloaded_threshold_applies_while_serving(vllm_pair: Pair, gw: Gateway) -> None:
    errors: list[str] = []
    stop = threading.Event()
    short = chat_messages(vllm_pair, 300)

    def keep_sending() -> None:
        with httpx.Client(timeout=E.REQUEST_TIMEOUT_S, limits=E.CLIENT_LIMITS) as client:
            while not stop.is_set():
                messages = [{"role": "user", "content": f"{uuid.uuid4().hex} a short question"}]
                r = client.post(
                    gw.url + "/v1/chat/completions", json={"model": E.MODEL_NAME, "messages": messages, **SAMPLING}
                )
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")

    def write(threshold: int) -> None:
        cfg["routing"]["decider"]["threshold"] = threshold
        tmp = gw.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        tmp.replace(gw.config_path)  # atomic, as editors and ConfigMaps do

    cfg = yaml.safe_load(gw.config_path.read_text())
    sender = threading.Thread(target=keep_sending)
    sender.start()
    try:
        assert plan(gw, short)["path"] == "direct"  # 300 tokens < 512
        write(256)  # while requests flow
        assert E.wait_until(lambda: plan(gw, short)["path"] == "pd", timeout=20), gw.proc.log_tail()
    finally:
        stop.set()
        sender.join(60)
    assert errors == []
    try:  # the counters prove the path only with no other traffic
        before = counters(vllm_pair, gw)
        r = chat(gw, short)
        assert r.status_code == 200 and r.headers["x-pdgate-path"] == "pd"
        expect_pd(vllm_pair, gw, before, 300)
    finally:
        write(THRESHOLD)
    assert E.wait_until(lambda: plan(gw, chat_messages(vllm_pair, 300))["path"] == "direct", timeout=20)


def test_a_decode_engine_killed_mid_stream_then_restarted(vllm_pair: Pair, gw: Gateway) -> None:
    """Reproduction 1 of issue 12: turn 1 (P/D), the decode engine dies and comes back with an
    empty cache; turn 2 must not go "direct, prefix_cached" onto it."""
    d = vllm_pair.decode
    messages, r1 = first_turn(vllm_pair, gw)
    turn2 = next_turn(messages, r1)
    assert plan(gw, turn2)["path"] == "direct"  # before the restart: believed cached, rightly
    restarts_before = restarts(gw)
    body = {
        "model": E.MODEL_NAME,
        "messages": chat_messages(vllm_pair, 60),
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                break
        E.kill(d)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    # An error event, then [DONE], as vLLM itself ends a stream that fails.
    assert rest[-1] == "[DONE]" and '"error"' in rest[-2], rest[-3:]
    E.restart(d)
    wait_decode_back(vllm_pair, gw, restarts_before)
    second_turn_is_pd(vllm_pair, gw, turn2)


def test_a_decode_engine_without_prefix_caching_gets_no_turn_as_cached(vllm_pair: Pair, gw: Gateway) -> None:
    """Reproduction 2: the engine says enable_prefix_caching="False" (vllm:cache_config_info)."""
    d = vllm_pair.decode
    restarts_before = restarts(gw)
    E.restart(d, without=["--enable-prefix-caching"], adding=["--no-enable-prefix-caching"])
    try:
        wait_decode_back(vllm_pair, gw, restarts_before)
        messages, r1 = first_turn(vllm_pair, gw)
        turn2 = next_turn(messages, r1)
        assert d.url not in plan(gw, turn2)["cached_tokens"]
        second_turn_is_pd(vllm_pair, gw, turn2)
    finally:
        restarts_before = restarts(gw)
        E.restart(d, without=["--no-enable-prefix-caching"], adding=["--enable-prefix-caching"])
        wait_decode_back(vllm_pair, gw, restarts_before)
