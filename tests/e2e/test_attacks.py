"""One client must not take the gateway down (issue 13): the real gateway process in front of a
simulated engine, attacked over raw sockets while legitimate clients keep using it.

- an endless request header, on a route with no key (``GET /health``);
- clients that send headers and part of their body, then stall, with an admission limit: they get
  408 and never hold the slots other clients need;
- connections that send nothing, or half a request line: closed after ``server.head_timeout_s``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY = "sk-attacks"


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(KEY)
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(
            10_000,
            auth={"api_keys_file": str(group.log_dir / "keys")},
            admission={"max_in_flight": 4, "queue_timeout_s": 2},
            server={"head_timeout_s": 1.0, "body_timeout_s": 3.0, "body_idle_timeout_s": 1.0, "max_connections": 200},
        )
        yield c
    finally:
        group.stop_all()


def chat(cluster: Cluster) -> int:
    r = httpx.post(
        cluster.url + "/v1/chat/completions",
        timeout=30,
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    return r.status_code


def connect(cluster: Cluster) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=10)
    return s


def answer(s: socket.socket) -> bytes:
    s.settimeout(10)
    out = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def metric(cluster: Cluster, name: str) -> float:
    return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, name)


def test_an_endless_header_is_refused_while_others_are_served(cluster):
    attacker = connect(cluster)
    attacker.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-E: ")
    stop = threading.Event()

    def flood() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                attacker.sendall(b"a" * 65536)

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        assert [chat(cluster) for _ in range(5)] == [200] * 5
        ready = httpx.get(cluster.url + "/ready", timeout=10).json()
        assert ready["pools"]["decode"]["healthy"] == 1  # health checks kept running
    finally:
        stop.set()
        flooder.join(10)
    got = answer(attacker)
    assert got.startswith(b"HTTP/1.1 431") and b"headers_too_large" in got


def test_stalled_bodies_get_408_and_hold_no_admission_slot(cluster):
    stalled = []
    for _ in range(4):  # as many as there are admission slots
        s = connect(cluster)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"model":'
        )
        stalled.append(s)
    time.sleep(0.2)  # let them reach the gateway; no slot may be taken while their bodies are unread
    assert metric(cluster, "pdgate_admission_in_flight") == 0
    assert [chat(cluster) for _ in range(3)] == [200] * 3  # nobody locked out
    for s in stalled:
        got = answer(s)
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got
        s.close()


def test_idle_and_half_sent_connections_are_closed(cluster):
    before = metric(cluster, "pdgate_http_connections")
    idle = [connect(cluster) for _ in range(40)]
    for i, s in enumerate(idle):
        if i % 2:
            s.sendall(b"GET /heal")  # half a request line, never finished
    assert wait_for(lambda: metric(cluster, "pdgate_http_connections") >= before + 40, timeout=5)
    for s in idle:
        assert answer(s).startswith(b"HTTP/1.1 408")
        s.close()
    assert wait_for(lambda: metric(cluster, "pdgate_http_connections") <= before + 1, timeout=5)
    assert chat(cluster) == 200
