"""Precise prefix routing follows a REAL vLLM engine's KV events, through the gateway.

The package's engine pair (NIXL P/D; the decode engine with ``--enable-prefix-caching`` and a ZMQ
``--kv-events-config``) behind a gateway that subscribes to the decode engine's feed, with the
prefix index on and an admin token for ``POST /debug/route``. The proof, on engine counters:

- a long prompt sent straight to the decode engine, never through the gateway, becomes known to
  the gateway through that engine's events alone: ``/debug/route`` now sends it direct to that
  engine (``prefix_cached``, whole blocks of it cached), and a real request does go there and is
  served from the engine's prefix cache (its ``local_cache_hit`` count rises by what the gateway
  said was cached; no KV moves, the prefill engine never sees it);
- after the engine's ``/reset_prefix_cache`` (AllBlocksCleared) the gateway forgets it, and the
  prompt takes the P/D path again, a real NIXL transfer.

The same scenario against the simulator is ``tests/e2e/test_kv_events_routing.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.promtext import sample

from . import engines as E
from .conftest import HASH_SEED, THRESHOLD, Gateway, Pair, start_gateway

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

TOKEN = "realvllm-kv-events-admin"
FILLER = "decode engines keep the conversation cache warm while the gateway follows their events "


@pytest.fixture(scope="module")
def kv_gateway(vllm_pair: Pair) -> Iterator[Gateway]:
    token_file = vllm_pair.group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    decode = {
        "url": vllm_pair.decode.url,
        "kv_events": vllm_pair.kv_events,
        "kv_events_replay": vllm_pair.kv_events_replay,
    }
    gw = start_gateway(
        vllm_pair,
        "gateway-kv-events",
        pools={"prefill": {"endpoints": [vllm_pair.prefill.url]}, "decode": {"endpoints": [decode]}},
        # hash_seed: the engine's PYTHONHASHSEED, so the gateway's block hashes are the engine's own
        routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"hash_seed": HASH_SEED}},
        admin={"token_file": str(token_file)},
    )
    try:
        ok = E.wait_until(
            lambda: httpx.get(gw.url + "/ready", timeout=5).json()["kv_event_feeds"]["connected"] == 1, timeout=30
        )
        assert ok, f"the gateway never connected to the decode engine's KV events:\n{gw.proc.log_tail()}"
        yield gw
    finally:
        gw.proc.stop()


def plan(gw: Gateway, messages: list[dict]) -> dict:
    body = {"model": E.MODEL_NAME, "messages": messages, "max_tokens": 4}
    r = httpx.post(gw.url + "/debug/route", json=body, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def engine_block_size(eng: E.Engine) -> int:
    for family in text_string_to_metric_families(eng.metrics()):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                return int(s.labels["block_size"])
    raise AssertionError("vllm:cache_config_info missing from the engine's /metrics")


def long_messages(eng: E.Engine, block_size: int, words: int = 550) -> tuple[list[dict], int]:
    """A chat prompt new to every engine (a uuid first) of about 2 tokens per word, and its engine
    token count, which is kept off a block boundary: vLLM never serves a prompt's last token from
    its cache, so the engine's cache hit then equals the gateway's whole cached blocks."""
    text = " ".join([uuid.uuid4().hex, *(FILLER.split() * (words // len(FILLER.split()) + 1))[:words]])
    while True:
        messages = [{"role": "user", "content": text}]
        n = eng.tokenize_chat(messages)
        if n % block_size:
            return messages, n
        text += " x"


def source(eng: E.Engine, name: str) -> float:
    return eng.metric(E.PROMPT_BY_SOURCE, source=name)


def test_routing_follows_the_engines_kv_events(vllm_pair: Pair, kv_gateway: Gateway) -> None:
    d, p = vllm_pair.decode, vllm_pair.prefill
    bs = engine_block_size(d)
    messages, n = long_messages(d, bs)
    assert THRESHOLD + bs < n < E.MAX_MODEL_LEN - 16
    # The gateway reads the engines' block size from their /metrics: hashes are only right after.
    assert E.wait_until(lambda: plan(kv_gateway, messages)["block_size"] == bs, timeout=30)
    first = plan(kv_gateway, messages)
    assert (first["path"], first["reason"], first["prompt_tokens"]) == ("pd", "long_uncached", n)
    assert first["cached_tokens"].get(d.url, 0) == 0

    # Another client sends the prompt straight to the decode engine: only its KV events can tell.
    body = {"model": E.MODEL_NAME, "messages": messages, "max_tokens": 2}
    r = d.http.post(d.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert E.wait_until(lambda: plan(kv_gateway, messages)["path"] == "direct", timeout=20), (
        f"the gateway never saw the engine's cache: {plan(kv_gateway, messages)}"
    )
    seen = plan(kv_gateway, messages)
    cached = n // bs * bs  # every whole block of the prompt
    assert (seen["decode"], seen["reason"], seen["cached_tokens"][d.url]) == (d.url, "prefix_cached", cached)

    # A real request through the gateway follows: direct, served from the engine's prefix cache.
    xfers, hits, local = d.metric(E.XFER_COUNT), source(d, "local_cache_hit"), source(d, "local_compute")
    prefilled = sample(p.metrics(), E.PROMPT_BY_SOURCE)
    r = httpx.post(kv_gateway.url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "direct"
    assert E.wait_until(lambda: source(d, "local_cache_hit") == hits + cached), (
        f"decode engine cache hits {source(d, 'local_cache_hit') - hits}, the gateway said {cached}"
    )
    assert source(d, "local_compute") == local + n - cached
    assert d.metric(E.XFER_COUNT) == xfers
    assert sample(p.metrics(), E.PROMPT_BY_SOURCE) == prefilled

    # The engine drops its cache. Its AllBlocksCleared event leaves with its next scheduler step,
    # so give it one (a prompt under one block: it stores nothing new).
    assert d.http.post(d.url + "/reset_prefix_cache").status_code == 200
    small = {"model": E.MODEL_NAME, "prompt": "hello", "max_tokens": 1}
    assert d.http.post(d.url + "/v1/completions", json=small).status_code == 200
    assert E.wait_until(lambda: plan(kv_gateway, messages)["path"] == "pd", timeout=20), (
        f"the gateway still routes on a dropped cache: {plan(kv_gateway, messages)}"
    )
    assert plan(kv_gateway, messages)["cached_tokens"].get(d.url, 0) == 0

    # And the real request takes the P/D path again: the decode engine pulls the KV over NIXL.
    r = httpx.post(kv_gateway.url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "pd"
    assert E.wait_until(lambda: d.metric(E.XFER_COUNT) == xfers + 1)
    assert d.metric(E.XFER_FAILED) == 0
    assert E.wait_until(lambda: sample(p.metrics(), E.PROMPT_BY_SOURCE) == prefilled + n)
    # The prefill engine frees the blocks once the decode engine has read them.
    assert E.wait_until(lambda: p.metric(E.KV_USAGE) == 0, timeout=10)
