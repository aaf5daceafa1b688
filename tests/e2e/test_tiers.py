"""End to end: KV tiers below the GPU (routing.tiers), on simulated engines with an L1 each and a
shared L2 on the Redis this machine runs, publishing their tier events as vLLM 0.32's offloading
connector does (sim/README.md, "KV offload tiers").

The tests run in order on one cluster: a prefix evicted from a decode engine's GPU stays believed
in its L1 and goes direct there; a prefix in L2 makes a long prompt direct on another engine, and
the engine's answer confirms it; an engine's restart drops its L1 beliefs but not L2's."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.procs import ProcGroup, free_port, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "tiers-admin"
GPU_BLOCKS = 300  # 4,800 tokens of 16: a few long prompts evict the oldest
DOC = "Tiered caches keep long prompts close to the engines that will need them again. "


def _prompt(tag: str, repeat: int = 30) -> str:
    return f"Case {tag}. " + DOC * repeat


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    l2 = ["--l2-url", "redis://127.0.0.1:6379/0", "--l2-key-prefix", f"pdgate-test-tiers-{uuid.uuid4().hex}"]
    c.decode_flags = {}  # what each decode engine was started with (the restart test starts it again)
    try:
        c.prefill.append(c.start_sim("prefill"))
        endpoints = []
        for _ in range(2):
            port, kv_port, pub, replay = free_port(), free_port(), free_port(), free_port()
            events = json.dumps(
                {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
            )
            flags = ["--kv-events-config", events, "--num-gpu-blocks", str(GPU_BLOCKS), "--cpu-blocks", "2000"]
            flags += [*l2, "--self-describing-kv-events", "--enable-prompt-tokens-details"]
            c.decode.append(c.start_sim("decode", *flags, port=port, kv_port=kv_port))
            c.decode_flags[port] = (flags, kv_port)
            endpoints.append(
                {
                    "url": c.decode[-1].url,
                    "kv_events": f"tcp://127.0.0.1:{pub}",
                    "kv_events_replay": f"tcp://127.0.0.1:{replay}",
                }
            )
        pools = {"prefill": {"endpoints": [s.url for s in c.prefill]}, "decode": {"endpoints": endpoints}}
        routing = {
            "decider": {"name": "token_threshold", "threshold": THRESHOLD},
            "tiers": {"enabled": True, "l1_blocks": 2000, "l2_blocks": 100_000, "chunk_tokens": 16},
        }
        signals = {"scrape_interval_s": 0.3}  # a restart is seen at the next scrape
        c.start_gateway(THRESHOLD, admin={"token_file": str(token_file)}, pools=pools, routing=routing, signals=signals)
        yield c
    finally:
        group.stop_all()


def plan(cluster, content: str) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    r = httpx.post(cluster.url + "/debug/route", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    return r.json()


def send_to(engine, content: str) -> dict:
    """Another client's request straight to an engine: only its KV events can tell the gateway."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_evicted_from_the_gpu_is_believed_in_l1_and_goes_direct_there(cluster):
    d0, _ = cluster.decode
    prompt = _prompt("L1")
    assert plan(cluster, prompt)["path"] == "pd"  # nothing held anywhere yet
    send_to(d0, prompt)
    assert wait_for(lambda: plan(cluster, prompt)["tiers"].get(d0.url, {}).get("gpu", 0) > 0, timeout=10)
    for i in range(8):  # other long prompts fill d0's GPU cache: the first prompt's blocks go
        send_to(d0, _prompt(f"filler {i}", repeat=40))

    def evicted_but_in_l1() -> bool:
        hold = plan(cluster, prompt)["tiers"].get(d0.url, {})
        return hold.get("gpu", 1) == 0 and hold.get("l1", 0) > THRESHOLD

    assert wait_for(evicted_but_in_l1, timeout=10), plan(cluster, prompt)["tiers"]

    def direct_to_d0() -> bool:  # once a scrape shows d0 idle again (the fillers ran there)
        p = plan(cluster, prompt)
        return (p["path"], p["decode"], p["reason"]) == ("direct", d0.url, "prefix_in_tier")

    assert wait_for(direct_to_d0, timeout=10), plan(cluster, prompt)
    p = plan(cluster, prompt)
    assert "l1=" in p["detail"]


def test_a_prefix_in_l2_makes_a_long_prompt_direct_on_another_engine(cluster):
    d0, d1 = cluster.decode
    prompt = _prompt("L2")
    send_to(d0, prompt)  # computed on d0: uploaded to the shared store (a REMOTE STORAGE tier)
    assert wait_for(lambda: plan(cluster, prompt)["tiers"].get(d1.url, {}).get("l2", 0) > THRESHOLD, timeout=10)
    d0.proc.stop()  # d0 gone: d1 is the decode engine left, and it can load the prefix from L2
    assert wait_for(lambda: plan(cluster, prompt)["decode"] == d1.url, timeout=10)
    p = plan(cluster, prompt)
    assert (p["path"], p["reason"]) == ("direct", "prefix_in_tier"), p
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "direct"
    served = r.json()["usage"]
    assert (served.get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= p["tiers"][d1.url]["l2"] - 16
    metrics = httpx.get(cluster.url + "/metrics").text
    assert wait_for(
        lambda: sample(httpx.get(cluster.url + "/metrics").text, "pdgate_tier_confirmed_tokens_total", tier="l2") > 0
    )
    assert "pdgate_tier_believed_tokens_total" in metrics


def test_a_restart_drops_the_engines_l1_beliefs_but_not_l2s(cluster):
    d0, _ = cluster.decode
    prompt = _prompt("L1")  # in d0's L1 and the shared store (the first test)
    flags, kv_port = cluster.decode_flags[d0.port]
    cluster.decode[0] = d0 = cluster.start_sim("decode", *flags, port=d0.port, kv_port=kv_port)  # a new run

    def l1_forgotten() -> bool:
        hold = plan(cluster, prompt)["tiers"].get(d0.url, {})
        return hold.get("l1", 1) == 0 and hold.get("l2", 0) > THRESHOLD

    assert wait_for(l1_forgotten, timeout=15), plan(cluster, prompt)["tiers"]


@pytest.fixture
def untiered(tokenizer_dir, tmp_path_factory):
    """Tiers on in the gateway, in front of engines that have none, whose answers do not carry
    cached_tokens: only the engines' hit counters can tell the gateway its L1 beliefs are wrong."""
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "admin-token").write_text(TOKEN)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode.append(c.start_sim("decode", "--num-gpu-blocks", str(GPU_BLOCKS)))
        routing = {
            "decider": {"name": "token_threshold", "threshold": THRESHOLD},
            "tiers": {"enabled": True, "l1_blocks": 2000, "counter_check": {"min_tokens": 1000}},
        }
        admin = {"token_file": str(group.log_dir / "admin-token")}
        c.start_gateway(THRESHOLD, admin=admin, routing=routing, signals={"scrape_interval_s": 0.3})
        yield c
    finally:
        group.stop_all()


def _ask(cluster, content: str) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_an_engine_whose_hit_counters_show_no_tier_loads_has_its_tiers_distrusted(untiered):
    (d,) = untiered.decode
    a, b, spare = _prompt("A"), _prompt("B"), _prompt("spare")
    for prompt in (a, b, spare):
        assert _ask(untiered, prompt).headers["x-pdgate-path"] == "pd"
    for i in range(8):  # the decode engine's GPU beliefs fill: the oldest go down to its L1
        _ask(untiered, _prompt(f"filler {i}", repeat=40))

    def in_l1() -> bool:
        return plan(untiered, spare)["tiers"][d.url].get("l1", 0) > THRESHOLD

    assert wait_for(in_l1, timeout=30), plan(untiered, spare)["tiers"]
    assert plan(untiered, spare)["reason"] == "prefix_in_tier"  # believed: the engine would load it
    for prompt in (a, b):  # sent direct to load from L1; the engine has no L1 and recomputes them
        assert _ask(untiered, prompt).headers["x-pdgate-path"] == "direct"

    def distrusted() -> bool:
        return sample(httpx.get(untiered.url + "/metrics").text, "pdgate_tier_distrusted", engine=d.url) == 1

    assert wait_for(distrusted, timeout=10)
    metrics = httpx.get(untiered.url + "/metrics").text
    assert sample(metrics, "pdgate_tier_counter_ratio", engine=d.url, tier="below") == 0
    p = plan(untiered, spare)  # its L1 beliefs are gone: a long prompt is P/D again
    assert p["tiers"][d.url].get("l1", 0) == 0 and (p["path"], p["reason"]) == ("pd", "long_uncached"), p
