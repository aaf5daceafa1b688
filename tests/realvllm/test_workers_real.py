"""A gateway of two worker processes in front of real vLLM engines (issue 15): a conversation whose
turns land on different workers is routed as one gateway would route it. Turn 1 goes through
worker 0 (P/D: a real NIXL transfer); turn 2, sent on a connection worker 1 holds, goes direct onto
the decode engine's real cache hit, which the engine's own counters confirm."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from . import engines as E
from .conftest import THRESHOLD, Gateway, Pair, start_gateway
from .test_real_vllm import chat_messages, counters, expect_pd
from .test_routing_beliefs import SAMPLING, by_source, next_turn

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]


@pytest.fixture(scope="module")
def gw2(vllm_pair: Pair) -> Iterator[Gateway]:
    gw = start_gateway(
        vllm_pair,
        "gateway-workers",
        server={"workers": 2},
        routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}},
    )
    try:
        yield gw
    finally:
        gw.proc.stop()


def clients_per_worker(gw: Gateway) -> dict[int, httpx.Client]:
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        c = httpx.Client(timeout=E.REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=1))
        w = c.get(gw.url + "/ready").json()["workers"]["this"]
        if w in found:
            c.close()
        else:
            found[w] = c
        if len(found) == 2:
            return found
    pytest.fail(f"200 connections reached only workers {sorted(found)}")


def reconnect(gw: Gateway, worker: int) -> httpx.Client:
    """A client whose one connection is to ``worker`` now."""
    for _ in range(200):
        c = httpx.Client(timeout=E.REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=1))
        if c.get(gw.url + "/ready").json()["workers"]["this"] == worker:
            return c
        c.close()
    pytest.fail(f"200 connections did not reach worker {worker}")


def test_turn_two_on_the_other_worker_goes_direct_on_a_real_cache_hit(vllm_pair: Pair, gw2: Gateway) -> None:
    d = vllm_pair.decode
    clients = clients_per_worker(gw2)
    try:
        messages = chat_messages(vllm_pair, 1500)
        before = counters(vllm_pair, gw2)
        r1 = clients[0].post(
            gw2.url + "/v1/chat/completions", json={"model": E.MODEL_NAME, "messages": messages, **SAMPLING}
        )
        assert r1.status_code == 200 and r1.headers["x-pdgate-path"] == "pd", r1.text
        expect_pd(vllm_pair, gw2, before, d.tokenize_chat(messages))
        turn2 = next_turn(messages, r1)
        n2 = d.tokenize_chat(turn2)
        hits, local = by_source(d, "local_cache_hit"), by_source(d, "local_compute")
        # Turn 1 on real CPU engines takes long enough for the server to drop worker 1's idle
        # connection: take one to worker 1 again right before turn 2.
        clients[1].close()
        clients[1] = reconnect(gw2, 1)
        r2 = clients[1].post(
            gw2.url + "/v1/chat/completions", json={"model": E.MODEL_NAME, "messages": turn2, **SAMPLING}
        )
        assert clients[1].get(gw2.url + "/ready").json()["workers"]["this"] == 1  # still worker 1
        assert r2.status_code == 200 and r2.headers["x-pdgate-path"] == "direct", r2.headers
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert n2 - cached < THRESHOLD  # the engine served the first turn from its cache
        assert E.wait_until(lambda: by_source(d, "local_cache_hit") == hits + cached)
        assert by_source(d, "local_compute") == local + n2 - cached
    finally:
        for c in clients.values():
            c.close()
