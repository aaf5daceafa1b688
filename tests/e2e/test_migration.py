"""Mid-stream migration end to end (issue 18): the gateway and simulated engines as real processes.

A decode engine is killed (``POST /sim/crash``: the process exits at once, its connections cut)
while it is in the middle of an answer. The simulator's output follows its context as greedy
decoding does, so the answer a client gets must be the very answer an uninterrupted run gives:
same text (nothing twice, nothing missing), as many tokens as asked for, one id, one finish reason,
usage that adds up. Chat and completions, streamed and not, on the direct and the P/D path; the
surviving engine's own record shows what it was sent. Where migration does not apply the client
gets the error event, as before.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster, Sim

pytestmark = pytest.mark.e2e

THRESHOLD = 200
MAX_TOKENS = 80
SHORT = "Tell me how a stream survives its engine."
LONG = "Migration drill. " + "The decode engine dies and the answer goes on on another one. " * 30
DECODE_ARGS = ("--decode-time-per-token", "0.01")


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode += [c.start_sim("decode", *DECODE_ARGS), c.start_sim("decode", *DECODE_ARGS)]
        # The path follows the prompt's length alone (no prefix routing): short direct, long P/D.
        c.start_gateway(
            THRESHOLD,
            routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}},
            health={"interval_s": 0.2, "timeout_s": 0.5},
        )
        yield c
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def all_engines_up(cluster):
    """Every test starts with both decode engines up (a test kills one or two, then they restart)."""
    yield
    for i, sim in enumerate(cluster.decode):
        if sim.proc.popen.poll() is not None:
            sim.proc.stop()
            cluster.decode[i] = cluster.start_sim("decode", *DECODE_ARGS, port=sim.port, kv_port=sim.kv_port)
    assert wait_for(lambda: httpx.get(cluster.url + "/ready").json()["pools"]["decode"]["healthy"] == 2, timeout=10)


def request(kind: str, prompt: str, stream: bool, **extra) -> tuple[str, dict]:
    if kind == "chat":
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    else:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS}
    body.update(stream=stream, **extra)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if kind == "chat" else "/v1/completions"), body


def serving(cluster: Cluster, rid: str) -> Sim:
    """The decode engine running request ``rid`` (its record is ``running``)."""
    found: list[Sim] = []

    def look() -> bool:
        for sim in cluster.decode:
            try:
                records = sim.requests()
            except httpx.HTTPError:
                continue
            if any(r.get("headers", {}).get("x-request-id") == rid and r.get("status") == "running" for r in records):
                found.append(sim)
                return True
        return False

    assert wait_for(look, timeout=10, interval=0.01), f"no decode engine runs {rid}"
    return found[0]


def crash(sim: Sim) -> None:
    with contextlib.suppress(httpx.HTTPError):  # it may die answering
        httpx.post(sim.url + "/sim/crash", timeout=5)
    sim.proc.popen.wait(timeout=10)


def read_stream(resp: httpx.Response, on_event=None) -> list[dict | str]:
    events: list[dict | str] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if on_event is not None:
                on_event(events)
    return events


def text_of(kind: str, events: list) -> str:
    out = ""
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices") or []:
                out += (c["delta"].get("content") or "") if kind == "chat" else (c.get("text") or "")
    return out


def whole_text(kind: str, body: dict) -> str:
    c = body["choices"][0]
    return c["message"]["content"] if kind == "chat" else c["text"]


def gateway_metric(cluster: Cluster, name: str, **labels: str) -> float:
    return sample(httpx.get(cluster.url + "/metrics", timeout=10).text, name, **labels)


def access_line(cluster: Cluster, rid: str) -> dict:
    return cluster.access_line(rid)


def kill_mid_answer(cluster: Cluster, route: str, body: dict, rid: str) -> tuple[httpx.Response, list, Sim]:
    """Send the request and kill its decode engine once it has generated part of the answer: a
    stream after a few events reached the client, a whole answer a while after it started."""
    headers = {"x-request-id": rid}
    victim: list[Sim] = []
    if body["stream"]:

        def kill_after_some(events: list) -> None:
            if not victim and len(events) == 12:
                victim.append(serving(cluster, rid))
                crash(victim[0])

        with httpx.stream("POST", cluster.url + route, json=body, headers=headers, timeout=30) as r:
            return r, read_stream(r, kill_after_some), victim[0]

    def kill_soon() -> None:
        victim.append(serving(cluster, rid))
        time.sleep(0.25)  # ~25 tokens at 10 ms each
        crash(victim[0])

    killer = threading.Thread(target=kill_soon)
    killer.start()
    r = httpx.post(cluster.url + route, json=body, headers=headers, timeout=30)
    killer.join()
    return r, [], victim[0]


@pytest.mark.parametrize("path", ["direct", "pd"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_decode_engine_killed_mid_answer_is_invisible_to_the_client(cluster, kind, stream, path):
    route, body = request(kind, LONG if path == "pd" else SHORT, stream)
    uninterrupted = httpx.post(
        cluster.url + route, json={**body, "stream": False, "stream_options": None}, timeout=30
    ).json()
    ok_before = gateway_metric(cluster, "pdgate_migrations_total", reason="disconnected", result="ok")
    rid = f"migrate-{uuid.uuid4().hex[:12]}"
    r, events, victim = kill_mid_answer(cluster, route, body, rid)
    assert r.status_code == 200 and r.headers["x-pdgate-path"] == path
    if stream:
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in e for e in chunks), chunks[-3:]
        assert text_of(kind, chunks) == whole_text(kind, uninterrupted)
        assert {e["id"] for e in chunks} == {f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"}
        assert [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]] == ["length"]
        usage = chunks[-1]["usage"]
    else:
        got = r.json()
        assert whole_text(kind, got) == whole_text(kind, uninterrupted)
        assert got["choices"][0]["finish_reason"] == "length"
        usage = got["usage"]
    assert usage["prompt_tokens"] == uninterrupted["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    # The other decode engine was sent the prompt's ids and the output kept, with the KV pulled from
    # the prefill engine when the context is long.
    [survivor] = [s for s in cluster.decode if s is not victim]
    [cont] = [q for q in survivor.requests() if q.get("headers", {}).get("x-request-id", "").startswith(rid)]
    prompt = cont["body"]["prompt"]
    kept = len(prompt) - uninterrupted["usage"]["prompt_tokens"]
    assert 0 < kept < MAX_TOKENS and cont["body"]["max_tokens"] == MAX_TOKENS - kept
    assert cont["kind"] == ("decode" if path == "pd" else "plain")  # the continuation's own route
    assert cont["status"] == "completed"
    line = access_line(cluster, rid)
    [m] = line["migrations"]
    assert (m["reason"], m["result"], m["from"], m["to"], m["path"], m["tokens"]) == (
        "disconnected",
        "ok",
        victim.url,
        survivor.url,
        path,
        kept,
    )
    assert line["status"] == 200 and line["output_tokens"] == MAX_TOKENS
    assert gateway_metric(cluster, "pdgate_migrations_total", reason="disconnected", result="ok") == ok_before + 1


def test_a_guided_decoding_request_still_ends_with_the_error_event(cluster):
    route, body = request("chat", SHORT, True, response_format={"type": "json_object"})
    before = gateway_metric(cluster, "pdgate_migrations_skipped_total", why="guided_decoding")
    r, events, _ = kill_mid_answer(cluster, route, body, f"guided-{uuid.uuid4().hex[:12]}")
    assert r.status_code == 200
    assert events[-1] == "[DONE]" and isinstance(events[-2], dict) and "error" in events[-2]
    assert gateway_metric(cluster, "pdgate_migrations_skipped_total", why="guided_decoding") == before + 1


def test_a_second_failure_after_one_migration_ends_with_the_error_event(cluster):
    route, body = request("completion", SHORT, True)
    uninterrupted = httpx.post(
        cluster.url + route, json={**body, "stream": False, "stream_options": None}, timeout=30
    ).json()
    rid = f"twice-{uuid.uuid4().hex[:12]}"
    killed: list[Sim] = []

    def kill_both(events: list) -> None:
        if len(events) == 10 and not killed:
            killed.append(serving(cluster, rid))
            crash(killed[0])
        elif len(events) == 20 and len(killed) == 1:  # the continuation is streaming: kill it too
            killed.append(serving(cluster, f"{rid}-m1"))
            crash(killed[1])

    with httpx.stream("POST", cluster.url + route, json=body, headers={"x-request-id": rid}, timeout=30) as r:
        events = read_stream(r, kill_both)
    assert len(killed) == 2 and killed[0] is not killed[1]
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert whole_text("completion", uninterrupted).startswith(text_of("completion", events[:-2]))
    [first, second] = access_line(cluster, rid)["migrations"]
    assert first["result"] == "failed" and (second["result"], second["why"]) == ("skipped", "limit")


def test_a_short_whole_answer_is_retried_from_the_start_not_migrated(cluster):
    """A non-streamed request asking for at most routing.migration.non_streaming_min_tokens (64)
    goes to its engine as sent; its engine killed mid-answer, the whole request runs again on the
    other one, and the client gets one whole answer."""
    route, body = request("chat", SHORT, False, max_tokens=64)
    rid = f"short-{uuid.uuid4().hex[:12]}"
    migrated = gateway_metric(cluster, "pdgate_migrations_total", reason="disconnected", result="ok")
    for sim in cluster.decode:  # each answer held 3 s: the kill (~0.25 s in) always comes first
        httpx.put(sim.url + "/sim/faults", json={"slow": {"first_byte_delay": 3.0}}, timeout=5).raise_for_status()
    try:
        r, _, victim = kill_mid_answer(cluster, route, body, rid)
    finally:
        for sim in cluster.decode:
            with contextlib.suppress(httpx.HTTPError):  # the killed one is gone
                httpx.delete(sim.url + "/sim/faults", timeout=5)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] == 64
    assert "decode_retried" in r.headers.get("x-pdgate-failover", "")
    survivor = next(sim for sim in cluster.decode if sim is not victim)
    [sent] = [q["body"] for q in survivor.requests() if q.get("headers", {}).get("x-request-id") == rid]
    assert "stream" not in sent or sent["stream"] is False
    assert "return_token_ids" not in sent
    assert gateway_metric(cluster, "pdgate_migrations_total", reason="disconnected", result="ok") == migrated
