"""A client that stops reading is not an engine falling silent (the gateway and a simulated engine
as real processes).

While a streaming client's connection is full, the gateway stops reading the engine's answer (it
holds the engine back rather than buffer without bound). The decode leg's idle bound
(``timeouts.decode_idle_s``) is about the engine: it must not run out while the client is the one
not reading, which would cut a healthy stream, or, with mid-stream migration on (the default),
continue it on another engine for nothing. A client that stops reading altogether is bounded by
``server.client_stall_timeout_s``: its connection is dropped (its engine request, if still
running, aborted), its admission slot freed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
IDLE_S = 1.0
PAUSE_S = 3.0
STALL_S = 6.0  # past the pause above
MAX_LEN = 24000


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("slow-client-logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        # a long answer (more than the sockets between gateway and client hold), fast; a second
        # engine to migrate to
        c.decode += [c.start_sim("decode", "--max-model-len", str(MAX_LEN)) for _ in range(2)]
        model = {"name": c.model, "tokenizer": str(tokenizer_dir), "max_model_len": MAX_LEN}
        c.start_gateway(
            100000,
            timeouts={"decode_idle_s": IDLE_S},
            models=[model],
            server={"client_stall_timeout_s": STALL_S},
        )
        yield c
    finally:
        group.stop_all()


def _open(cluster: Cluster, body: dict) -> socket.socket:
    """A streamed chat request sent on a socket with a small receive window (the gateway's send
    buffer fills soon after the client stops reading)."""
    payload = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", cluster.gateway_port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload)
    )
    return sock


def _read_head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        more = sock.recv(4096)
        assert more, "the gateway closed before the response head"
        head += more
    return head


def _chunked_body(raw: bytes) -> bytes:
    body, rest = b"", raw
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2 :]


@pytest.mark.parametrize("migration", [True, False], ids=["migratable", "byte-for-byte"])
def test_a_client_that_pauses_longer_than_the_idle_bound_gets_its_whole_answer(cluster, migration):
    def migrations() -> float:  # every leg cut mid-way counts here: migrated, failed, skipped
        return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, "pdgate_migrations_total")

    before = migrations()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write at length."}],
        "stream": True,
        "max_tokens": MAX_LEN - 100,
        "ignore_eos": True,
    }
    if not migration:
        body["response_format"] = {"type": "json_object"}  # guided decoding: never migrated, relayed as is
    sock = _open(cluster, body)
    try:
        head = _read_head(sock)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        time.sleep(PAUSE_S)  # reads nothing for three times the engine idle bound
        raw = head.split(b"\r\n\r\n", 1)[1]
        while more := sock.recv(1 << 16):
            raw += more
    finally:
        sock.close()
    events = [e for e in _chunked_body(raw).split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"error"' in e[:20] for e in events), [e for e in events if b'"error"' in e[:20]][:1]
    assert len(raw) > 500_000  # enough to fill every buffer between the engine and the client
    assert migrations() == before


def test_a_client_that_stops_reading_is_disconnected_and_its_slot_freed(cluster):
    def metric(name: str) -> float:
        return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, name)

    for sim in cluster.decode:
        sim.clear()
    stalled = metric("pdgate_http_connections_stalled_total")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}], "stream": True}
    sock = _open(cluster, {**body, "max_tokens": MAX_LEN - 100, "ignore_eos": True})
    try:
        assert _read_head(sock).startswith(b"HTTP/1.1 200")
        # reads nothing: once the buffers fill, the stall bound runs
        assert wait_for(lambda: metric("pdgate_http_connections_stalled_total") == stalled + 1, timeout=30)
        tail = b""
        with contextlib.suppress(ConnectionResetError):  # a reset: what was buffered for it is dropped
            while more := sock.recv(1 << 20):
                tail = (tail + more)[-64:]
        assert not tail.endswith(b"\r\n0\r\n\r\n")  # not the whole answer
    finally:
        sock.close()
    assert wait_for(lambda: metric("pdgate_endpoint_in_flight_requests") == 0, timeout=5)
    assert wait_for(lambda: metric("pdgate_admission_in_flight") == 0, timeout=5)
    # (the engine's request, if still running, is aborted as for any client that leaves:
    # tests/e2e/test_splice.py; here the engine is fast enough to have finished into the buffers)
    assert wait_for(lambda: not [r for sim in cluster.decode for r in sim.requests() if r["status"] == "running"])
    # the gateway serves on as before
    ok = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "max_tokens": 5}, timeout=30)
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
