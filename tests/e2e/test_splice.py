"""The byte-for-byte relay's fast path (gateway/http/splice.py, ``engines.splice``) on a real gateway
process in front of a simulated engine, mid-stream migration off so every stream takes it: the
client gets exactly what the engine sent, per-token metrics still count every chunk, and a client
that leaves mid-stream still makes the engine abort."""

from __future__ import annotations

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
ROUTING = {"decider": {"name": "token_threshold", "threshold": 100000}, "migration": {"enabled": False}}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "stream": True, "max_tokens": 12}


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("splice-logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.05"))
        c.start_gateway(100000, routing=ROUTING)
        yield c
    finally:
        group.stop_all()


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def test_a_spliced_stream_is_the_engines_stream_and_every_chunk_is_counted(cluster):
    direct = httpx.post(cluster.decode[0].url + "/v1/chat/completions", json=BODY, timeout=30)
    before = sample(httpx.get(cluster.url + "/metrics").text, "pdgate_inter_token_latency_seconds_count")
    relayed = httpx.post(cluster.url + "/v1/chat/completions", json=BODY, timeout=30)
    assert relayed.status_code == 200 and relayed.headers["content-type"].startswith("text/event-stream")
    # the same events, byte for byte but for the engine's own ids and timestamps
    strip = [e.split(b'"choices"', 1)[1] for e in _events(relayed.content)[:-1]]
    assert strip == [e.split(b'"choices"', 1)[1] for e in _events(direct.content)[:-1]]
    assert _events(relayed.content)[-1] == b"data: [DONE]"
    tokens = sum(1 for e in _events(relayed.content) if b'"content":"' in e and b'"content":""' not in e)
    assert wait_for(
        lambda: (
            sample(httpx.get(cluster.url + "/metrics").text, "pdgate_inter_token_latency_seconds_count") - before
            >= tokens - 1
        )
    )


def test_a_client_leaving_a_spliced_stream_makes_the_engine_abort(cluster):
    cluster.decode[0].clear()
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", cluster.url + "/v1/chat/completions", json={**BODY, "max_tokens": 400}) as resp,
    ):
        raw = resp.iter_raw()
        next(raw)
        next(raw)  # well into the spliced part
    assert wait_for(lambda: [r["status"] for r in cluster.decode[0].requests()] == ["aborted"], timeout=5)
    assert wait_for(lambda: sample(httpx.get(cluster.url + "/metrics").text, "pdgate_endpoint_in_flight_requests") == 0)
