"""A bounded, seeded fuzz run against the real gateway process: request bodies (types, nesting,
sizes, encodings), headers and HTTP framing. Whatever a client sends, the gateway answers without
a 500, keeps running, keeps /health answering, and logs no traceback. The seed is printed on
failure; ``PDGATE_FUZZ_SEED`` replays a run, ``PDGATE_FUZZ_CASES`` sizes it."""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Callable

import httpx
import pytest

from tests.procs import ProcGroup

from .cluster import Cluster

pytestmark = pytest.mark.e2e
SEED = int(os.environ.get("PDGATE_FUZZ_SEED", random.SystemRandom().randrange(1 << 30)))
CASES = int(os.environ.get("PDGATE_FUZZ_CASES", "300"))


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(
            64,
            limits={"max_output_tokens": 256, "max_header_bytes": 8192},
            server={"head_timeout_s": 2.0, "body_idle_timeout_s": 2.0},
        )
        yield c
    finally:
        group.stop_all()


def value(rng: random.Random, depth: int = 0) -> object:
    kinds: list[Callable[[], object]] = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.randint(-(2**63), 2**64),
        lambda: rng.random() * 10 ** rng.randint(-5, 30),
        lambda: "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 40))),
        lambda: "x" * rng.choice([0, 1, 1000, 100_000]),
        lambda: float("nan") if rng.random() < 0.1 else -1,
    ]
    if depth < 4:
        kinds += [
            lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
            lambda: {rng.choice(FIELDS): value(rng, depth + 1) for _ in range(rng.randint(0, 4))},
        ]
    return rng.choice(kinds)()


FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
    "tool_choice",
    "kv_transfer_params",
    "vllm_xargs",
    "cache_salt",
    "chat_template",
    "chat_template_kwargs",
    "role",
    "content",
    "type",
    "text",
    "add_generation_prompt",
    "continue_final_message",
    "include_usage",
]


def body(rng: random.Random) -> bytes:
    base: dict = {"model": "tiny", "max_tokens": 2}
    if rng.random() < 0.5:
        base["messages"] = [{"role": "user", "content": "hello"}]
    else:
        base["prompt"] = "hello"
    for _ in range(rng.randint(1, 5)):
        base[rng.choice(FIELDS)] = value(rng)
    raw = json.dumps(base, allow_nan=True).encode()
    roll = rng.random()
    if roll < 0.1:  # broken JSON
        raw = raw[: rng.randint(0, len(raw))]
    elif roll < 0.15:  # invalid UTF-8
        raw = raw.replace(b"hello", b"\xff\xfe\xfa")
    elif roll < 0.2:  # deep nesting
        raw = b'{"model":"tiny","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    return raw


def raw_request(rng: random.Random, port: int) -> bytes:
    """An HTTP request with odd framing, sent over a raw socket; returns what came back."""
    payload = body(rng)
    path = rng.choice(
        [
            b"/v1/chat/completions",
            b"/v1/completions",
            b"/v1/models",
            b"/health",
            b"/%00",
            b"/" + b"a" * 3000,
            b"/v1/chat/completions/",
            b"*",
        ]
    )
    headers = [b"Host: x", b"Content-Type: application/json"]
    framing = rng.random()
    if framing < 0.3:
        headers.append(b"Content-Length: %d" % len(payload))
        wire = payload
    elif framing < 0.5:
        headers.append(b"Transfer-Encoding: chunked")
        wire = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
        if rng.random() < 0.3:
            wire = wire.replace(b"\r\n", b"\n", 1)  # broken chunk framing
    elif framing < 0.6:
        headers.append(b"Content-Length: %d" % (len(payload) + rng.randint(1, 50)))  # shorter than said
        wire = payload
    elif framing < 0.7:
        headers.append(b"Content-Length: -5")
        wire = payload
    else:
        headers.append(b"Content-Length: %d" % len(payload))
        headers += [b"X-Junk-%d: %s" % (i, b"v" * rng.randint(0, 2000)) for i in range(rng.randint(0, 12))]
        wire = payload
    method = rng.choice([b"POST", b"POST", b"GET", b"PUT", b"BREW"])
    request = method + b" " + path + b" HTTP/1.1\r\n" + b"\r\n".join(headers) + b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            s.sendall(request + wire)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out
        except OSError:  # the gateway closed first (a refused head): nothing more to read
            return b""


def test_whatever_a_client_sends_the_gateway_answers_without_a_500(cluster):
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=30) as client:
        for i in range(CASES):
            if rng.random() < 0.5:
                path = rng.choice(["/v1/chat/completions", "/v1/completions"])
                r = client.post(cluster.url + path, content=body(rng), headers={"content-type": "application/json"})
                status = r.status_code
                if status < 400 and b'"stream": true' not in r.content:
                    assert r.headers.get("content-type", "").startswith(("application/json", "text/event-stream"))
            else:
                got = raw_request(rng, cluster.gateway_port)
                status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0
            statuses[status] = statuses.get(status, 0) + 1
            assert status != 500, f"seed {SEED}, case {i}: 500"
            if i % 50 == 49:
                assert client.get(cluster.url + "/health", timeout=5).status_code == 200, f"seed {SEED}, case {i}"
    assert cluster.gateway is not None and cluster.gateway.popen.poll() is None, f"seed {SEED}: gateway died"
    log = cluster.gateway.log_path.read_text(errors="replace")
    assert "Traceback" not in log, f"seed {SEED}:\n{log[-3000:]}"
    assert statuses.get(200, 0) > 0 and any(s >= 400 for s in statuses), statuses
