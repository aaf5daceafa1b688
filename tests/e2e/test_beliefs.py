"""Routing beliefs that match the engines, end to end: the real gateway in front of simulated engines
(one prefill, one decode), routing from what it learned (no KV event feeds), as a user would meet
the three ways beliefs went wrong (issue 12):

1. the decode engine restarts between two turns of a conversation: its cache is gone, and the
   next turn must not go direct as "cached";
2. the decode engine runs without prefix caching: no turn ever goes direct as "cached";
3. an engine refuses a request: the prompt must not count as cached afterwards.

The same scenarios on real vLLM engines: ``tests/realvllm/test_routing_beliefs.py``.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "beliefs-admin-token"
REPORT = "the prefill pool computes the prompt and the decode pool streams the answer back. " * 40
DECODE_FLAGS = ("--enable-prompt-tokens-details", "--decode-time-per-token", "0.001")


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode.append(c.start_sim("decode", *DECODE_FLAGS))
        c.start_gateway(
            THRESHOLD,
            admin={"token_file": str(token_file)},
            models=[
                {"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096},
                {"name": "ghost", "tokenizer": str(tokenizer_dir), "max_model_len": 4096},
            ],
            signals={"scrape_interval_s": 0.2, "scrape_timeout_s": 2.0, "max_age_s": 5.0},
        )
        yield c
    finally:
        group.stop_all()


def chat(cluster: Cluster, messages: list[dict], model: str = "tiny", **kw) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 4, **kw}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)


def conversation(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"{topic}: {REPORT}"}]


def next_turn(messages: list[dict], reply: httpx.Response) -> list[dict]:
    said = reply.json()["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": "And then?"}]


def gateway_metric(cluster: Cluster, name: str, **labels: str) -> float:
    return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, name, **labels)


def restart_decode(cluster: Cluster, *flags: str) -> None:
    """Stop the decode engine and start a new one on the same port; returns once the gateway has
    noticed the new run (pdgate_endpoint_restarts_total) and routes to it again."""
    before = gateway_metric(cluster, "pdgate_endpoint_restarts_total", pool="decode")
    old = cluster.decode.pop()
    old.proc.stop()
    cluster.decode.append(cluster.start_sim("decode", *flags, port=old.port, kv_port=old.kv_port))

    def back() -> bool:
        ready = httpx.get(cluster.url + "/ready", timeout=10).json()
        return (
            ready["pools"]["decode"]["healthy"] == 1
            and gateway_metric(cluster, "pdgate_endpoint_restarts_total", pool="decode") > before
        )

    assert wait_for(back, timeout=15), "the gateway never noticed the decode engine's restart"
    # The restart may have been noticed before the new run's /metrics answered (a recovery whose
    # scrape failed): a few scrape intervals (0.2 s) for its flags (prefix caching) to be read.
    time.sleep(1.0)


def test_turn_two_goes_direct_on_a_cache_the_engine_really_has(cluster):
    """The happy path first: the learned belief is right, and the engine's own count agrees."""
    messages = conversation("first")
    r1 = chat(cluster, messages)
    assert r1.status_code == 200 and r1.headers["x-pdgate-path"] == "pd"
    exact = gateway_metric(cluster, "pdgate_prefix_belief_checks_total", pool="decode", result="exact")
    r2 = chat(cluster, next_turn(messages, r1))
    assert r2.status_code == 200 and r2.headers["x-pdgate-path"] == "direct"
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > THRESHOLD  # the engine did serve the first turn from its cache
    assert wait_for(
        lambda: (
            gateway_metric(cluster, "pdgate_prefix_belief_checks_total", pool="decode", result="exact") == exact + 1
        ),
        timeout=5,
    )


def test_a_restarted_decode_engine_is_not_believed_to_hold_its_old_cache(cluster):
    messages = conversation("restart")
    r1 = chat(cluster, messages)
    assert r1.status_code == 200 and r1.headers["x-pdgate-path"] == "pd"
    restart_decode(cluster, *DECODE_FLAGS)
    r2 = chat(cluster, next_turn(messages, r1))
    assert r2.status_code == 200
    # Long and uncached on the new engine: P/D, not "direct, prefix_cached" onto an empty cache.
    assert r2.headers["x-pdgate-path"] == "pd"


def test_an_engine_without_prefix_caching_gets_no_prefix_credit(cluster):
    restart_decode(cluster, *DECODE_FLAGS, "--no-enable-prefix-caching")
    try:
        messages = conversation("no caching")
        r1 = chat(cluster, messages)
        assert r1.status_code == 200 and r1.headers["x-pdgate-path"] == "pd"
        r2 = chat(cluster, next_turn(messages, r1))
        assert r2.status_code == 200 and r2.headers["x-pdgate-path"] == "pd"
        plan = httpx.post(
            cluster.url + "/debug/route",
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=30,
            json={"model": "tiny", "messages": next_turn(messages, r1)},
        ).json()
        assert cluster.decode[0].url not in plan["cached_tokens"]
    finally:
        restart_decode(cluster, *DECODE_FLAGS)


def test_a_request_the_engine_refuses_is_not_learned(cluster):
    messages = conversation("refused")
    r = chat(cluster, messages, logprobs=True, top_logprobs=30)  # the engines refuse logprobs (400)
    assert r.status_code == 400, r.text
    r = chat(cluster, messages)
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == "pd"  # not "direct, prefix_cached"


def test_a_model_no_engine_serves_is_reported_not_sent(cluster):
    """Configured but not served: /ready and /metrics name it; a request gets a clear 503, and no
    engine sees it (instead of a 404 from the engine)."""
    ready = httpx.get(cluster.url + "/ready", timeout=10).json()
    missing = {(m["pool"], tuple(m["missing"])) for m in ready["models"]["mismatched"]}
    assert missing == {("prefill", ("ghost",)), ("decode", ("ghost",))}
    assert gateway_metric(cluster, "pdgate_endpoint_model_missing", pool="decode", model="ghost") == 1
    for sim in cluster.prefill + cluster.decode:
        sim.clear()
    r = chat(cluster, conversation("ghost"), model="ghost")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_served"
    assert all(sim.requests() == [] for sim in cluster.prefill + cluster.decode)
