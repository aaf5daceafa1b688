"""End to end: two gateway replicas share routing state through a real Redis, and keep serving
on local state while Redis is down."""

from __future__ import annotations

import shutil
import threading
import time
import uuid

import httpx
import pytest

from tests.procs import Proc, ProcGroup, free_port, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
THRESHOLD = 200
TOKEN = "shared-state-admin"
DOC = "Replica notes: both gateways must agree on where each prompt lives. " * 30


def start_redis(group: ProcGroup, port: int) -> Proc:
    proc = group.start(
        f"redis-{port}",
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
    )
    assert wait_for(lambda: _redis_answers(port), timeout=10), proc.log_tail()
    return proc


def _redis_answers(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Replicas:
    def __init__(self, cluster: Cluster, group: ProcGroup, redis_port: int) -> None:
        self.cluster, self.group, self.redis_port = cluster, group, redis_port
        self.redis = start_redis(group, redis_port)
        self.urls: list[str] = []


@pytest.fixture(scope="module")
def replicas(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN)
    try:
        r = Replicas(c, group, free_port())
        c.prefill.append(c.start_sim("prefill"))
        c.decode += [
            c.start_sim("decode", "--decode-time-per-token", "0.01"),
            c.start_sim("decode", "--decode-time-per-token", "0.01"),
        ]
        state = {
            "backend": "redis",
            "url": f"redis://127.0.0.1:{r.redis_port}/0",
            "key_prefix": f"pdgate-test-{uuid.uuid4().hex[:8]}",
            "sync_interval_s": 0.2,
            "retry_s": 0.5,
        }
        for _ in range(2):
            c.start_gateway(THRESHOLD, state=state, admin={"token_file": str(token_file)})
            r.urls.append(c.url)
        yield r
    finally:
        group.stop_all()


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def decode_engine(cluster: Cluster, request_id: str) -> str:
    [url] = [s.url for s in cluster.decode for q in s.requests() if q["headers"].get("x-request-id") == request_id]
    return url


def test_affinity_holds_across_replicas(replicas):
    a, b = replicas.urls
    first = chat(a, "Case affinity. " + DOC)
    assert first.headers["x-pdgate-path"] == "pd"
    home = decode_engine(replicas.cluster, first.headers["x-request-id"])
    # replica B never saw this prompt: it knows where it lives from Redis
    assert wait_for(
        lambda: (
            httpx.post(
                b + "/debug/route",
                headers={"authorization": f"Bearer {TOKEN}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "Case affinity. " + DOC}]},
            ).json()["path"]
            == "direct"
        ),
        timeout=5,
    )
    again = chat(b, "Case affinity. " + DOC)
    assert again.headers["x-pdgate-path"] == "direct"
    assert decode_engine(replicas.cluster, again.headers["x-request-id"]) == home


def test_in_flight_counts_are_shared(replicas):
    """Streams held open through replica A make replica B send new requests elsewhere."""
    a, b = replicas.urls
    started: list[str] = []

    def hold() -> None:
        body = {"model": "tiny", "prompt": "long stream", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", a + "/v1/completions", json=body, timeout=30) as r:
            started.append(decode_engine(replicas.cluster, r.headers["x-request-id"]))
            for _ in r.iter_bytes():
                pass

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: len(started) == 4, timeout=10)

        def seen_by_b() -> dict[str, int]:
            plan = httpx.post(
                b + "/debug/route",
                headers={"authorization": f"Bearer {TOKEN}"},
                json={"model": "tiny", "prompt": "short"},
            ).json()
            return {e["url"]: e["in_flight"] for e in plan["endpoints"] if e["pool"] == "decode"}

        # B has nothing in flight itself: only the shared counts can tell it about A's streams.
        expected = {s.url: started.count(s.url) for s in replicas.cluster.decode}
        assert wait_for(lambda: seen_by_b() == expected, timeout=5), (seen_by_b(), expected)
    finally:
        for t in threads:
            t.join(timeout=30)


def test_redis_down_then_back(replicas):
    a, b = replicas.urls
    replicas.redis.stop()
    try:
        worst = 0.0
        for i in range(10):
            for url in (a, b):
                t0 = time.perf_counter()
                chat(url, f"Case outage {i}. " + DOC)  # long prompts: they look Redis up
                worst = max(worst, time.perf_counter() - t0)
        assert worst < 5, worst  # bounded: a Redis failure costs at most its timeout, not a hang
        for url in (a, b):
            ready = httpx.get(url + "/ready").json()
            assert ready["ready"] is True and ready["shared_state"]["healthy"] is False
            assert sample(httpx.get(url + "/metrics").text, "pdgate_shared_state_up", backend="redis") == 0
    finally:
        replicas.redis = start_redis(replicas.group, replicas.redis_port)
    for url in (a, b):
        assert wait_for(lambda u=url: httpx.get(u + "/ready").json()["shared_state"]["healthy"], timeout=10)
    # shared again: B learns what A routes
    first = chat(a, "Case recovered. " + DOC)
    assert first.headers["x-pdgate-path"] == "pd"
    assert wait_for(lambda: chat(b, "Case recovered. " + DOC).headers["x-pdgate-path"] == "direct", timeout=5)
