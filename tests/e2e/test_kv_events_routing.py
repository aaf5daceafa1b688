"""End to end: precise prefix routing from the engines' own KV events. The gateway learns what a
decode engine caches even from traffic it never routed, and forgets it when the engine drops it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import ProcGroup, free_port, wait_for

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "kv-events-admin"
DOC = "Quarterly capacity review: decode engines keep the conversation cache warm. " * 30


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    try:
        c.prefill.append(c.start_sim("prefill"))
        feeds = []
        for _ in range(2):
            pub, replay = free_port(), free_port()
            # As on a real engine: the publisher binds a wildcard address (vLLM connects, instead of
            # binding, to any other address), and the gateway connects to it.
            flag = json.dumps(
                {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
            )
            c.decode.append(c.start_sim("decode", "--kv-events-config", flag, env={"VLLM_SERVER_DEV_MODE": "1"}))
            feeds.append((f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"))
        pools = {  # endpoints as objects: each decode engine with its event feed
            "prefill": {"endpoints": [s.url for s in c.prefill]},
            "decode": {
                "endpoints": [
                    {"url": s.url, "kv_events": pub, "kv_events_replay": replay}
                    for s, (pub, replay) in zip(c.decode, feeds, strict=True)
                ]
            },
        }
        c.start_gateway(THRESHOLD, admin={"token_file": str(token_file)}, pools=pools)
        yield c
    finally:
        group.stop_all()


def plan(cluster, content: str) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    r = httpx.post(cluster.url + "/debug/route", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_engine_cache_seen_through_events_then_cleared(cluster):
    _, d1 = cluster.decode
    prompt = "Case events. " + DOC
    assert plan(cluster, prompt)["path"] == "pd"
    # Another client sends the document straight to decode 1: only its KV events can tell.
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    assert httpx.post(d1.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert wait_for(lambda: plan(cluster, prompt)["path"] == "direct", timeout=10)
    p = plan(cluster, prompt)
    assert p["decode"] == d1.url and p["reason"] == "prefix_cached"
    assert p["cached_tokens"][d1.url] >= p["prompt_tokens"] - p["block_size"]
    # The real request goes there too.
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.headers["x-pdgate-path"] == "direct"
    assert any(q["headers"].get("x-request-id") == r.headers["x-request-id"] for q in d1.requests())
    # The engine drops its cache (AllBlocksCleared): the gateway forgets too, learned entries included.
    assert httpx.post(d1.url + "/reset_prefix_cache", timeout=10).status_code == 200
    assert wait_for(lambda: plan(cluster, prompt)["path"] == "pd", timeout=10)
