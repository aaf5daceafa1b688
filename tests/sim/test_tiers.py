"""Two sim processes sharing an L2 in Redis (127.0.0.1:6379): a prompt computed on one engine is
loaded from the L2 by the other, and both say so where a user looks (usage, /metrics, /sim/state,
the KV events)."""

from __future__ import annotations

import json
import shlex
import uuid

import httpx
import msgspec
import pytest
import zmq

from engine_model.kv_events import END_SEQ
from tests.procs import ProcGroup, free_port, wait_for
from tests.sim.conftest import SimProc, start_sims

pytestmark = pytest.mark.e2e

REDIS = "redis://127.0.0.1:6379/0"
PROMPT = list(range(7000, 7100))  # 100 tokens: 6 full blocks a hit can cover (99 // 16)


def redis_or_skip() -> None:
    import redis

    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        pytest.skip("no Redis on 127.0.0.1:6379")


def replay(endpoint: str) -> list[dict]:
    """Every event the engine published so far (vLLM's replay protocol, from sequence 0)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[dict] = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.extend(msgspec.msgpack.decode(payload)[1])
    finally:
        sock.close(linger=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    redis_or_skip()
    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    group = ProcGroup(tmp_path_factory.mktemp("sim-tier-logs"))
    http = httpx.Client(timeout=30)
    replays = {}
    specs = {}
    for name in ("a", "b"):
        replays[name] = f"tcp://127.0.0.1:{free_port()}"
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",  # nobody subscribes: the replay buffer is read
            "replay_endpoint": replays[name],
        }
        specs[name] = (
            f"--engine-id tier-{name} --cpu-blocks 64 --l2-url {REDIS} --l2-key-prefix {prefix} "
            f"--l2-latency 0.02 --enable-prompt-tokens-details --kv-events-config {shlex.quote(json.dumps(events))}"
        )
    try:
        sims = start_sims(group, specs, http)
        yield sims, replays
    finally:
        http.close()
        group.stop_all()
        import redis

        redis.Redis.from_url(REDIS).delete(f"{prefix}:lru", f"{prefix}:clock")


def complete(sim: SimProc, prompt: list[int]) -> dict:
    r = sim.http.post(sim.url + "/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_prefilled_on_one_engine_is_an_l2_hit_on_the_other(pair):
    sims, replays = pair
    a, b = sims["a"], sims["b"]
    first = complete(a, PROMPT)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert wait_for(lambda: a.state()["tiers"]["l2_stored"] >= 6), a.state()
    state_a = a.state()["tiers"]
    assert state_a["l1"]["blocks"] >= 6 and state_a["l2"]["blocks"] >= 6 and state_a["l2"]["reachable"] is True

    second = complete(b, PROMPT)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 blocks loaded from the L2
    assert b.metric("vllm:prompt_tokens_cached_by_source_total", source="disk") == 96
    assert b.metric("vllm:external_prefix_cache_hits_total") == 96
    assert b.metric("vllm:prefix_cache_hits_total") == 0  # not from B's GPU
    assert b.state()["tiers"]["l2_hit_tokens"] == 96
    third = complete(b, PROMPT)  # now on B's GPU
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert b.metric("vllm:prefix_cache_hits_total") == 96

    ev_a = replay(replays["a"])
    storage = [e for e in ev_a if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
    assert len(storage) >= 6 and {e["locality"] for e in storage} == {"REMOTE"}
    hashes = [e["block_hashes"][0] for e in storage[:6]]
    ev_b = replay(replays["b"])
    cpu = [e["block_hashes"][0] for e in ev_b if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    gpu = [h for e in ev_b if e["type"] == "BlockStored" and e["medium"] == "GPU" for h in e["block_hashes"]]
    assert cpu[:6] == hashes and gpu[:6] == hashes  # promoted into B's L1, then loaded to its GPU
    assert not [e for e in ev_b if e.get("medium") == "STORAGE"]  # B uploaded nothing new


def test_state_shows_each_tier(pair):
    sims, _ = pair
    tiers = sims["a"].state()["tiers"]
    assert tiers["l1"]["capacity"] == 64
    assert tiers["l2"]["store"] == "redis" and tiers["l2"]["capacity"] == 100_000
