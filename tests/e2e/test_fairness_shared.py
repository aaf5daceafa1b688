"""Fairness across gateway replicas: tenant use is shared on Redis (real Redis, two gateways)."""

from __future__ import annotations

import shutil
import uuid

import httpx
import pytest

from tests.procs import ProcGroup, free_port, wait_for
from tests.promtext import sample

from .cluster import Cluster
from .test_fairness import engine_order, holding, in_background
from .test_shared_state import start_redis

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
ADMIN = "admin-token-s"


@pytest.fixture(scope="module")
def replicas(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text("sk-flood tenant=flood\nsk-calm tenant=calm\n")
    (group.log_dir / "admin").write_text(ADMIN)
    try:
        port = free_port()
        start_redis(group, port)
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.02"))
        state = {
            "backend": "redis",
            "url": f"redis://127.0.0.1:{port}/0",
            "key_prefix": f"pdgate-test-{uuid.uuid4().hex[:8]}",
            "sync_interval_s": 0.2,
            "retry_s": 0.5,
        }
        urls = []
        for _ in range(2):
            c.start_gateway(
                10_000,
                state=state,
                auth={"api_keys_file": str(group.log_dir / "keys")},
                admin={"token_file": str(group.log_dir / "admin")},
                admission={"max_per_decode_endpoint": 2, "queue_timeout_s": 30},
                fairness={"enabled": True},
            )
            urls.append(c.url)
        yield c, urls
    finally:
        group.stop_all()


def chat(url: str, key: str, rid: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {key}", "x-request-id": rid},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    )


def test_a_tenant_flooding_one_replica_waits_behind_others_on_another(replicas):
    cluster, (a, b) = replicas
    sim, a_port = cluster.decode[0], int(a.rsplit(":", 1)[1])

    def flood_use_seen_by_b() -> float:
        return sample(httpx.get(b + "/metrics").text, "pdgate_tenant_decode_use", tenant="flood") or 0

    def queued_on_b() -> float:
        return sample(httpx.get(b + "/metrics").text, "pdgate_pool_queued_requests", pool="decode")

    # The flood holds the decode engine's two slots through replica A until it hangs up.
    with holding(a_port, sim, "direct", "sk-flood", "hold-1", max_tokens=100):
        with holding(a_port, sim, "direct", "sk-flood", "hold-2", max_tokens=100):
            # B served nothing for flood: only Redis can tell it about A's requests (their use and,
            # in the same sync, their in-flight counts)
            assert wait_for(lambda: flood_use_seen_by_b() > 150, timeout=10)
            # On B, a flood request queues first, then a calm one.
            flood = in_background(chat, b, "sk-flood", "b-flood")
            assert wait_for(lambda: queued_on_b() == 1, timeout=10)
            calm = in_background(chat, b, "sk-calm", "b-calm")
            assert wait_for(lambda: queued_on_b() == 2, timeout=10)
        # one slot frees (A's hold-2 hangs up): B gives it to the calm tenant first
        assert wait_for(lambda: "b-calm" in engine_order(cluster), timeout=10)
    for t, out in [flood, calm]:
        t.join(timeout=60)
        assert out and out[0].status_code == 200, out
    order = engine_order(cluster)
    assert order.index("b-calm") < order.index("b-flood"), order
