"""End to end: tenants from API keys, fair queueing across them, priorities to the engine, and
sheddable requests past their TTFT objective (simulated engines, real processes on loopback)."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
ADMIN = "admin-token-f"
KEYS = {"flood": "sk-flood", "calm": "sk-calm", "batch": "sk-batch", "vip": "sk-vip"}
FAIRNESS = {
    "enabled": True,
    "engine_priority": True,
    "classes": {
        "interactive": {"priority": -10},
        "standard": {"priority": 0},
        "batch": {"priority": 10, "ttft_slo_s": 0.5, "sheddable": True},
    },
}


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(
        "sk-flood tenant=flood\nsk-calm tenant=calm\nsk-batch tenant=batchy priority=batch\n"
        "sk-vip tenant=vip allow=interactive\n"
    )
    (group.log_dir / "admin").write_text(ADMIN)
    try:
        c.prefill.append(c.start_sim("prefill", "--prefill-time-per-token", "0.0005"))  # 1,000 tokens: 0.5 s
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.02"))
        c.start_gateway(
            10_000,
            auth={"api_keys_file": str(group.log_dir / "keys")},
            admin={"token_file": str(group.log_dir / "admin")},
            admission={"max_per_decode_endpoint": 1, "queue_timeout_s": 30},
            fairness=FAIRNESS,
        )
        yield c
    finally:
        group.stop_all()


BASE = {
    "fairness": FAIRNESS,
    "admission": {"max_per_decode_endpoint": 1, "queue_timeout_s": 30},
    "routing": {"decider": {"name": "token_threshold", "threshold": 10_000}},
}


@pytest.fixture(autouse=True)
def clean(cluster):
    if any(cluster.config[k] != v for k, v in BASE.items()):
        reconfigure(cluster, **BASE)
    for sim in (*cluster.prefill, *cluster.decode):
        sim.clear()


def admin_config(cluster) -> dict:
    return httpx.get(cluster.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}).json()["config"]


def reconfigure(cluster, **changes) -> None:
    cfg = copy.deepcopy(cluster.config)
    cfg.update(changes)
    cluster.config_path.write_text(yaml.safe_dump(cfg))
    cluster.config = cfg
    assert wait_for(lambda: all(_within(v, admin_config(cluster)[k]) for k, v in changes.items()), timeout=15)


def _within(want, got) -> bool:
    """``want``'s keys hold ``got``'s values (the served config also has the defaults)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _within(v, got[k]) for k, v in want.items())
    return want == got


def chat(
    cluster, tenant: str, rid: str | None = None, content: str = "hi", max_tokens: int = 2, **headers: str
) -> httpx.Response:
    headers["authorization"] = f"Bearer {KEYS[tenant]}"
    if rid:
        headers["x-request-id"] = rid
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def in_background(fn, *args, **kw) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kw)), daemon=True)
    t.start()
    return t, out


def engine_order(cluster) -> list[str]:
    return [q["request_id"] for q in sorted(cluster.decode[0].requests(), key=lambda q: q["received_at"])]


@contextlib.contextmanager
def holding(
    gateway_port: int, sim, on: str, key: str, rid: str = "hold", content: str = "hi", max_tokens: int = 5
) -> Iterator[None]:
    """A request (API key ``key``) that holds one of ``sim``'s admission slots until the block ends
    (the engine never answers it: a ``hang`` fault on its ``on`` legs); its client then hangs up,
    which frees the slot. What follows is ordered by the gateway's queue, whatever this process's pace."""

    def hung() -> int:
        return httpx.get(sim.url + "/sim/faults", timeout=10).json()["injected"].get("hang", 0)

    before = hung()
    httpx.put(sim.url + "/sim/faults", json={"hang": {"on": [on], "count": 1}}, timeout=10).raise_for_status()
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", gateway_port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\nx-request-id: " + rid.encode() + b"\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert wait_for(lambda: hung() > before, timeout=10), f"{rid} never reached the engine"
        yield
    finally:
        sock.close()
        httpx.delete(sim.url + "/sim/faults", timeout=10)


def queue_up(cluster, pool: str, sends: list[tuple]) -> list:
    """Each request sent once the one before is seen waiting in ``pool``'s queue (the gateway's
    gauge): their arrival order is the list's."""
    threads = []
    for n, (args, kw) in enumerate(sends, start=1):
        threads.append(in_background(chat, cluster, *args, **kw))
        assert wait_for(
            lambda n=n: sample(httpx.get(cluster.url + "/metrics").text, "pdgate_pool_queued_requests", pool=pool) == n,
            timeout=15,
        ), f"request {n} never queued for {pool}"
    return threads


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
def test_a_flooding_key_cannot_starve_another(cluster, fair):
    reconfigure(cluster, fairness={**FAIRNESS, "enabled": fair})
    # the flood holds the engine's one slot
    with holding(cluster.gateway_port, cluster.decode[0], "direct", KEYS["flood"]):
        threads = queue_up(
            cluster,
            "decode",
            [(("flood", f"flood-{i}"), {"max_tokens": 5}) for i in range(4)] + [(("calm", "calm"), {})],
        )  # the flood queues up first
    for t, out in threads:
        t.join(timeout=60)
        assert out[0].status_code == 200
    order = engine_order(cluster)
    assert order[0] == "hold"  # the engine saw it (and never answered)
    if fair:  # the flood holds the decode pool: the calm tenant goes first when the slot frees
        assert order[1] == "calm", order
    else:  # FIFO: behind every flood request
        assert order[1:] == ["flood-0", "flood-1", "flood-2", "flood-3", "calm"], order


def test_a_flood_of_long_prompts_waits_behind_another_tenants_in_the_prefill_pool(cluster):
    reconfigure(
        cluster,
        admission={"max_per_prefill_endpoint": 1, "max_per_decode_endpoint": 8, "queue_timeout_s": 30},
        routing={"decider": {"name": "token_threshold", "threshold": 500}},
    )
    long = "many words here " * 300  # ~1,000 tokens: P/D, 0.5 s on the prefill engine
    with holding(cluster.gateway_port, cluster.prefill[0], "prefill", KEYS["flood"], content="hold " + long):
        floods = [(("flood", f"flood-{i}"), {"content": f"{i} " + long}) for i in range(3)]
        threads = queue_up(cluster, "prefill", [*floods, (("calm", "calm"), {"content": "calm " + long})])
    for t, out in threads:
        t.join(timeout=60)
        assert out[0].status_code == 200 and out[0].headers["x-pdgate-path"] == "pd", out
    order = [q["request_id"] for q in sorted(cluster.prefill[0].requests(), key=lambda q: q["received_at"])]
    # waiting for the prefill pool (not sent direct), the calm tenant's prompt before the flood's
    assert order[:2] == ["hold", "calm"] and len(order) == 5, order
    text = httpx.get(cluster.url + "/metrics").text
    assert (
        sample(text, "pdgate_tenant_prefill_tokens_total", tenant="flood", priority="standard")
        > sample(text, "pdgate_tenant_prefill_tokens_total", tenant="calm", priority="standard")
        > 900
    )


def test_priorities_reach_the_engine(cluster):
    assert chat(cluster, "vip", "v1", **{"x-pdgate-priority": "interactive"}).status_code == 200
    assert chat(cluster, "calm", "c1").status_code == 200
    bodies = {q["request_id"]: q["body"] for q in cluster.decode[0].requests()}
    assert bodies["v1"]["priority"] == -10
    assert "priority" not in bodies["c1"]  # the default class's 0 is vLLM's default: not sent
    # the key may not use a class it was not given; a client's own priority field is refused
    r = chat(cluster, "calm", "c2", **{"x-pdgate-priority": "interactive"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
    r = httpx.post(
        cluster.url + "/v1/chat/completions",
        headers={"authorization": "Bearer sk-calm"},
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": -100},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert set(bodies) == {"v1", "c1"}  # the refused ones never reached an engine


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_decode_use_is_what_the_answer_took_not_what_was_guessed(cluster, stream):
    """A request without max_tokens is charged fairness.default_output_tokens (256) while it runs;
    at its end, the tokens it produced (the engine's default here: 16)."""

    def use() -> float:
        return sample(httpx.get(cluster.url + "/metrics").text, "pdgate_tenant_decode_use", tenant="vip")

    before = use()
    r = httpx.post(
        cluster.url + "/v1/chat/completions",
        headers={"authorization": "Bearer sk-vip"},
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "ignore_eos": True},
    )
    assert r.status_code == 200
    if stream:  # a token per event, and [DONE] and the opening role chunk
        assert r.text.count("data: ") == 16 + 2
    else:
        assert r.json()["usage"]["completion_tokens"] == 16
    assert use() - before == pytest.approx(16, abs=2)  # the vip tenant's earlier use fades meanwhile


def test_a_sheddable_request_past_its_objective_gets_429_at_once(cluster):
    before = (
        sample(
            httpx.get(cluster.url + "/metrics").text,
            "pdgate_route_decisions_total",
            path="shed",
            reason="ttft_objective",
        )
        or 0
    )
    # an objective no engine can meet (1 ms for a few hundred prompt tokens): refused without waiting
    t0 = time.monotonic()
    r = chat(cluster, "batch", "b1", content="many words here " * 40, **{"x-pdgate-ttft-ms": "1"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_objective_unattainable", r.text
    # the prompt alone misses the objective: a retry cannot help, so no Retry-After invites one
    assert "retry-after" not in r.headers and "a retry will not meet it" in r.json()["error"]["message"]
    assert "predicted TTFT" in r.json()["error"]["message"]
    # the same objective for a request that may not be shed: it waits and is served
    assert chat(cluster, "calm", "c1", content="many words here " * 40, **{"x-pdgate-ttft-ms": "1"}).status_code == 200
    # queued behind a long request: the batch class's 0.5 s objective passes while it waits
    hold, _ = in_background(chat, cluster, "flood", "hold", max_tokens=150)  # 3 s
    assert wait_for(lambda: cluster.decode[0].requests()[-1]["request_id"] == "hold", timeout=10)
    r = chat(cluster, "batch", "b2")
    waited = time.monotonic() - t0
    assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_objective_unattainable", r.text
    assert waited < 3  # not the 30 s queue timeout, nor the hold's end
    assert int(r.headers["retry-after"]) >= 1  # the queue, not the prompt, misses it: later may do
    hold.join(timeout=30)
    ids = [q["request_id"] for q in cluster.decode[0].requests()]
    assert "b1" not in ids and "b2" not in ids
    text = httpx.get(cluster.url + "/metrics").text
    assert sample(text, "pdgate_route_decisions_total", path="shed", reason="ttft_objective") == before + 2
    assert sample(text, "pdgate_tenant_requests_total", tenant="batchy", priority="batch", outcome="shed") >= 2
    assert sample(text, "pdgate_tenant_requests_total", tenant="calm", priority="standard", outcome="admitted") >= 1


def test_debug_route_shows_the_prediction_and_verdict(cluster):
    def plan(**headers: str) -> dict:
        headers["authorization"] = f"Bearer {ADMIN}"
        return httpx.post(
            cluster.url + "/debug/route",
            headers=headers,
            json={"model": "tiny", "messages": [{"role": "user", "content": "many words here " * 40}]},
        ).json()

    shed = plan(**{"x-pdgate-tenant": "batchy", "x-pdgate-priority": "batch", "x-pdgate-ttft-ms": "1"})["admission"]
    assert shed["verdict"] == "shed" and shed["tenant"] == "batchy" and shed["priority"] == "batch"
    assert shed["predicted_ttft_s"] > 0.001 and "objective" in shed["reason"]
    ok = plan(**{"x-pdgate-priority": "batch", "x-pdgate-ttft-ms": "60000"})["admission"]
    assert ok["verdict"] == "admit" and ok["predicted_ttft_s"] < 60
    assert plan()["admission"]["reason"] == "no TTFT objective"
