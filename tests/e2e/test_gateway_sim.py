"""End to end: the real gateway process in front of simulated vLLM engines, driven by the official
``openai`` client as an application would drive it."""

from __future__ import annotations

import socket
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
# These tests are about the handshake and the API: a repeated long prompt must take the P/D path
# again, not go direct because the prefix index remembers it.
STATELESS = {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}}
LONG = "Summarize the following design note in one line. " + "The decode pool streams tokens. " * 120
SHORT = "Say hello."


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode += [c.start_sim("decode"), c.start_sim("decode")]
        c.start_gateway(THRESHOLD, routing=STATELESS)
        yield c
    finally:
        group.stop_all()


@pytest.fixture
def client(cluster):
    for sim in cluster.prefill + cluster.decode:
        sim.clear()
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def legs(cluster) -> tuple[list[dict], list[dict]]:
    return ([r for s in cluster.prefill for r in s.requests()], [r for s in cluster.decode for r in s.requests()])


def chat(client, content, **kw):
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8, **kw
    )


def test_short_chat_goes_direct(cluster, client):
    raw = chat(client, SHORT)
    assert raw.headers["x-pdgate-path"] == "direct"
    out = raw.parse()
    assert out.choices[0].message.content and out.usage.completion_tokens == 8
    prefill, decode = legs(cluster)
    assert prefill == [] and len(decode) == 1
    assert decode[0]["body"].get("kv_transfer_params") is None


def test_long_chat_goes_prefill_then_decode(cluster, client):
    before = sum(
        sample(s.metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for s in cluster.decode
    )
    raw = chat(client, LONG)
    assert raw.headers["x-pdgate-path"] == "pd"
    out = raw.parse()
    assert out.usage.prompt_tokens >= THRESHOLD and out.usage.completion_tokens == 8
    [pre], [dec] = legs(cluster)
    assert pre["kind"] == "prefill" and dec["kind"] == "decode"
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["stream"] is False
    assert dec["body"]["kv_transfer_params"]["remote_engine_id"]
    assert pre["headers"]["x-request-id"] == dec["headers"]["x-request-id"] == raw.headers["x-request-id"]
    after = sum(
        sample(s.metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for s in cluster.decode
    )
    assert after > before  # the decode engine really pulled KV from the prefill engine


@pytest.mark.parametrize("content", [SHORT, LONG])
def test_streaming_chat_with_usage(cluster, client, content):
    with client.chat.completions.with_streaming_response.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        assert resp.headers["x-pdgate-path"] == ("pd" if content == LONG else "direct")
        chunks = list(resp.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_completions_stream_and_not(cluster, client, prompt):
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5)
    assert out.choices[0].text and out.usage.completion_tokens == 5
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text  # deterministic
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.parametrize(
    "messages",
    [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And now?"},
        ],
        [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
        [{"role": "user", "content": SHORT}, {"role": "assistant", "content": None}],
    ],
    ids=["multi-turn", "content-parts", "null-content"],
)
def test_gateway_token_count_equals_engine_count(cluster, client, messages):
    """The gateway's own count (its header) equals what the engine bills in usage."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=1)
    assert int(raw.headers["x-pdgate-prompt-tokens"]) == raw.parse().usage.prompt_tokens


@pytest.mark.parametrize("content", [SHORT, LONG])
def test_client_kv_transfer_params_never_reach_an_engine(cluster, client, content):
    evil = {
        "do_remote_prefill": True,
        "remote_host": "203.0.113.7",
        "remote_port": 22,
        "remote_engine_id": "attacker",
        "remote_block_ids": [[1]],
        "remote_request_id": "x",
    }
    chat(client, content, extra_body={"kv_transfer_params": evil})
    prefill, decode = legs(cluster)
    assert len(prefill) + len(decode) == (2 if content == LONG else 1)
    for leg in prefill + decode:
        assert "203.0.113.7" not in orjson.dumps(leg["body"]).decode()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{oops", 400),
        (b'{"model": "other", "prompt": "x"}', 404),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "9"}', 400),
        (b'{"model": "tiny", "prompt": "' + b"many words " * 3000 + b'"}', 400),
    ],
)
def test_bad_input_never_reaches_an_engine(cluster, client, body, status):
    r = httpx.post(cluster.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and r.json()["error"]["message"]
    assert legs(cluster) == ([], [])


def test_ready_models_and_metrics(cluster, client):
    assert httpx.get(cluster.url + "/ready").json()["ready"] is True
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat(client, SHORT)
    text = httpx.get(cluster.url + "/metrics").text
    assert sample(text, "pdgate_requests_total", path="direct", status="200") >= 1


@pytest.fixture(scope="module")
def slow(tokenizer_dir, tmp_path_factory):
    """Engines slow enough to leave mid-request: ~2 s of prefill, 0.2 s per decoded token."""
    group = ProcGroup(tmp_path_factory.mktemp("slow-logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill.append(c.start_sim("prefill", "--prefill-time-per-token", "0.005"))
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.2"))
        c.start_gateway(THRESHOLD, routing=STATELESS)
        yield c
    finally:
        group.stop_all()


def _send_and_hang_up(port: int, path: str, body: dict, once: Callable[[], bool]) -> None:
    """Send a request on a raw socket and close it, before any response byte, once ``once()``."""
    payload = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload)
        )
        assert wait_for(once, timeout=10)


def _read_first_chunk_and_leave(url: str, body: dict) -> None:
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as resp:
        next(resp.iter_raw())


def test_disconnect_during_prefill_aborts_the_prefill_leg(slow):
    for s in slow.prefill + slow.decode:
        s.clear()
    hung_up = sample(httpx.get(slow.url + "/metrics").text, "pdgate_requests_total", status="499")
    _send_and_hang_up(
        slow.gateway_port,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "stream": True},
        once=lambda: bool(slow.prefill[0].requests()),
    )  # the prefill leg is running
    assert wait_for(lambda: [r["status"] for r in slow.prefill[0].requests()] == ["aborted"])
    # The gateway has finished with the request (counted as a client hang-up): no leg can start now.
    assert wait_for(
        lambda: sample(httpx.get(slow.url + "/metrics").text, "pdgate_requests_total", status="499") == hung_up + 1
    )
    assert slow.decode[0].requests() == []  # the decode leg never started
    assert wait_for(lambda: sample(slow.prefill[0].metrics(), "vllm:kv_cache_usage_perc") == 0)


def test_disconnect_during_decode_stream_aborts_the_decode_leg(slow):
    for s in slow.prefill + slow.decode:
        s.clear()
    _read_first_chunk_and_leave(
        slow.url + "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "stream": True, "max_tokens": 200},
    )
    assert wait_for(lambda: [r["status"] for r in slow.decode[0].requests()] == ["aborted"], timeout=5)
    assert wait_for(lambda: sample(httpx.get(slow.url + "/metrics").text, "pdgate_endpoint_in_flight_requests") == 0)


def test_unhealthy_decode_endpoint_is_skipped_until_it_recovers(cluster, client):
    victim = cluster.decode[1]
    victim.proc.stop()
    assert wait_for(lambda: httpx.get(cluster.url + "/ready").json()["pools"]["decode"]["healthy"] == 1)
    for _ in range(6):
        assert chat(client, SHORT).parse().choices[0].message.content
    assert cluster.decode[0].requests()  # all went to the survivor
    revived = cluster.start_sim("decode", port=victim.port, kv_port=victim.kv_port)
    cluster.decode[1] = revived
    assert wait_for(lambda: httpx.get(cluster.url + "/ready").json()["pools"]["decode"]["healthy"] == 2)
    for _ in range(6):
        chat(client, SHORT)
    assert revived.requests()  # back in rotation


def _in_flight(cluster) -> float:
    return sample(httpx.get(cluster.url + "/metrics").text, "pdgate_endpoint_in_flight_requests")


def test_disconnect_during_pd_decode_aborts_the_decode_leg_and_frees_everything(slow):
    for s in slow.prefill + slow.decode:
        s.clear()
    _read_first_chunk_and_leave(
        slow.url + "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "stream": True, "max_tokens": 200},
    )
    assert wait_for(lambda: [r["status"] for r in slow.decode[0].requests()] == ["aborted"], timeout=5)
    assert [r["status"] for r in slow.prefill[0].requests()] == ["completed"]
    assert wait_for(lambda: _in_flight(slow) == 0)
    for sim in slow.prefill + slow.decode:
        assert wait_for(lambda sim=sim: sample(sim.metrics(), "vllm:kv_cache_usage_perc") == 0)


def test_disconnect_during_a_non_streaming_request_aborts_it(slow):
    for s in slow.prefill + slow.decode:
        s.clear()
    _send_and_hang_up(
        slow.gateway_port,
        "/v1/completions",
        {"model": "tiny", "prompt": SHORT, "max_tokens": 200},
        once=lambda: bool(slow.decode[0].requests()),
    )  # the engine is generating
    assert wait_for(lambda: [r["status"] for r in slow.decode[0].requests()] == ["aborted"], timeout=5)
    assert wait_for(lambda: _in_flight(slow) == 0)
    assert sample(httpx.get(slow.url + "/metrics").text, "pdgate_requests_total", status="499") >= 1
