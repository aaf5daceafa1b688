"""Connections held without a key (issue 27, point 1): the real gateway process in front of a
simulated engine, attacked over raw sockets.

The attack: a request whose head declares a body (``Content-Length: 10``) on a route that answers
without reading it (``GET /health``, ``GET /metrics``, ``POST /v1/chat/completions`` without a key:
401); the client reads the answer, sends one byte of the body and stays idle. Before the fix such a
connection stayed open for good (the head timer had stopped, no body timer ran, and the byte
cancelled uvicorn's keep-alive timer), and ~9,700 of them kept new clients at 503. Now an answer
written before its request's body has arrived closes the connection (``connection: close``), as
does every 401 and 403; a body nobody reads is bounded by ``server.body_timeout_s`` and
``server.body_idle_timeout_s`` on every route; and legitimate slow uploads and long streams go on.
"""

from __future__ import annotations

import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY = "sk-connections"
TOKEN = "connections-admin-token"
MAX_CONNECTIONS = 50
# the gateway's bounds in this module (server.*): small, so that a connection they do not close
# is plainly one that nothing closes
HEAD_S, BODY_S, BODY_IDLE_S, KEEP_ALIVE_S = 1.0, 3.0, 1.0, 2.0
CLOSED_WITHIN_S = 15.0  # far past every bound above (and the 1 s linger), far short of "forever"


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(KEY)
    (group.log_dir / "admin-token").write_text(TOKEN)
    try:
        # 20 ms a token: a 250-token stream lasts ~5 s, past the body and keep-alive bounds
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.02"))
        c.start_gateway(
            10_000,
            auth={"api_keys_file": str(group.log_dir / "keys")},
            admin={"token_file": str(group.log_dir / "admin-token")},
            server={
                "head_timeout_s": HEAD_S,
                "body_timeout_s": BODY_S,
                "body_idle_timeout_s": BODY_IDLE_S,
                "keep_alive_timeout_s": KEEP_ALIVE_S,
                "max_connections": MAX_CONNECTIONS,
            },
        )
        yield c
    finally:
        group.stop_all()


def connect(cluster: Cluster) -> socket.socket:
    return socket.create_connection(("127.0.0.1", cluster.gateway_port), timeout=10)


def read_answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (content-length framed, as the gateway's non-streaming answers are)."""
    s.settimeout(10)
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {raw!r}"
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = s.recv(65536)
        assert chunk, "closed in the middle of an answer"
        body += chunk
    return int(lines[0].split(" ", 2)[1]), headers, body


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the gateway closes ``s`` within ``seconds`` (anything it sends meanwhile is read)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if not s.recv(65536):
                return True
    except ConnectionError:  # reset: closed too
        return True
    except TimeoutError:
        return False
    return False


def metric(cluster: Cluster, name: str) -> float:
    return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, name)


ATTACKS = {
    "health": b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
    "metrics": b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
    "chat-without-key": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 10\r\n\r\n",
}


def attack(cluster: Cluster, head: bytes) -> tuple[socket.socket, int, dict[str, str]]:
    """The issue's attack: the head, read the answer, one byte of the body, then nothing."""
    s = connect(cluster)
    s.sendall(head)
    status, headers, _ = read_answer(s)
    with contextlib.suppress(ConnectionError):  # the gateway may be closing already
        s.sendall(b"{")
    return s, status, headers


@pytest.mark.parametrize("route", list(ATTACKS))
def test_an_answer_before_the_body_closes_the_connection(cluster, route):
    s, status, headers = attack(cluster, ATTACKS[route])
    try:
        assert status == (401 if route == "chat-without-key" else 200)
        assert headers.get("connection") == "close"  # the client is told it cannot reuse it
        assert closed_within(s, CLOSED_WITHIN_S), "the connection is still open"
    finally:
        s.close()


def test_a_request_without_a_key_gets_its_401_and_the_connection_closes(cluster):
    """A whole request, answered 401: an unauthenticated client does not keep the connection."""
    s = connect(cluster)
    try:
        body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        status, headers, answer = read_answer(s)
        assert status == 401 and orjson.loads(answer)["error"]["code"] == "invalid_api_key"
        assert headers.get("connection") == "close"
        assert closed_within(s, CLOSED_WITHIN_S)
    finally:
        s.close()


def test_many_attack_connections_no_longer_lock_out_new_clients(cluster):
    """40 attack connections against a cap of 50: before the fix they held 40 places for good and
    10 of 20 new clients got 503; now they are closed and all 20 are served."""
    before = metric(cluster, "pdgate_http_connections")
    held = []
    try:
        for i in range(40):
            s, status, _ = attack(cluster, list(ATTACKS.values())[i % len(ATTACKS)])
            held.append(s)
            assert status in (200, 401)
        assert all(closed_within(s, CLOSED_WITHIN_S) for s in held)
        assert wait_for(lambda: metric(cluster, "pdgate_http_connections") <= before + 1, timeout=CLOSED_WITHIN_S)

        def new_client(_: int) -> int:
            s = connect(cluster)
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status = read_answer(s)[0]
                time.sleep(1.0)  # all 20 held at once
                return status
            finally:
                s.close()

        with ThreadPoolExecutor(20) as pool:
            assert list(pool.map(new_client, range(20))) == [200] * 20
    finally:
        for s in held:
            s.close()


def test_a_body_nobody_reads_is_bounded_by_the_body_timeouts(cluster):
    """A route that answers only once its body is read: the body stops after one byte; the gateway
    answers 408 within the body idle bound, and closes."""
    s = connect(cluster)
    try:
        s.sendall(
            b"POST /debug/route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        started = time.monotonic()
        status, _, answer = read_answer(s)
        assert (status, orjson.loads(answer)["error"]["code"]) == (408, "request_timeout")
        assert time.monotonic() - started < CLOSED_WITHIN_S
        assert closed_within(s, CLOSED_WITHIN_S)
    finally:
        s.close()


def test_a_slow_upload_within_the_body_timeout_is_served(cluster):
    """A body trickled in pieces, each within the idle bound, the whole within the body timeout."""
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "slow " * 20}], "max_tokens": 2})
    pieces = [body[i : i + len(body) // 4 + 1] for i in range(0, len(body), len(body) // 4 + 1)]
    s = connect(cluster)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        for piece in pieces:
            time.sleep(BODY_IDLE_S / 2)
            s.sendall(piece)
        status, headers, answer = read_answer(s)
        assert status == 200, answer
        assert headers.get("connection") != "close"  # a served client keeps its connection
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(s)[0] == 200
    finally:
        s.close()


def test_a_stream_longer_than_every_connection_bound_is_whole(cluster):
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            cluster.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "long"}],
                "max_tokens": 250,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r,
    ):
        started = time.monotonic()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        took = time.monotonic() - started
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert took > max(BODY_S + 1.0, KEEP_ALIVE_S)  # it did outlast the bounds (the guard's body one: +1 s grace)


def test_websocket_handshakes_leave_no_connection_behind(cluster):
    """uvicorn's WebSocket upgrade handed the socket to its WebSocket protocol behind the guard:
    the connection never left the open count, so ``max_connections`` handshakes (no key needed)
    refused every client for good. The gateway serves no WebSockets: answered as HTTP, closed."""
    before = metric(cluster, "pdgate_http_connections")
    for _ in range(10):
        s = connect(cluster)
        try:
            s.sendall(
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            status, headers, _ = read_answer(s)
            assert (status, headers.get("connection")) == (200, "close")
            s.sendall(b"\x81\x05hello")  # a frame nobody reads
            assert closed_within(s, CLOSED_WITHIN_S)
        finally:
            s.close()
    assert wait_for(lambda: metric(cluster, "pdgate_http_connections") <= before, timeout=CLOSED_WITHIN_S)
    assert "Unsupported upgrade" not in (cluster.gateway.log_tail(200) if cluster.gateway else "")
