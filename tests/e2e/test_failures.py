"""End to end: engines fail (simulator fault modes) and the gateway keeps serving: retries,
fallback to the direct path, errors in the OpenAI stream format, ejection, nothing hung."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from gateway.engines.pools import HealthChecker
from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
LONG = "Failure drill. " + "The engines fail and the gateway keeps serving every request. " * 30


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill += [c.start_sim("prefill"), c.start_sim("prefill")]
        c.decode += [
            c.start_sim("decode", "--decode-time-per-token", "0.005"),
            c.start_sim("decode", "--decode-time-per-token", "0.005"),
        ]
        c.start_gateway(
            THRESHOLD,
            routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}},
            health={
                "interval_s": 0.3,
                "timeout_s": 0.5,
                "outlier": {"consecutive_failures": 3, "base_ejection_s": 0.5, "max_ejection_s": 1},
            },
            timeouts={"connect_s": 1, "prefill_s": 2, "decode_first_byte_s": 2, "decode_idle_s": 1},
        )
        yield c
    finally:
        group.stop_all()


def faults(sim, spec: dict | None) -> None:
    if spec is None:
        httpx.delete(sim.url + "/sim/faults", timeout=5).raise_for_status()
    else:
        httpx.put(sim.url + "/sim/faults", json=spec, timeout=5).raise_for_status()


@pytest.fixture(autouse=True)
def clean(cluster):
    for sim in cluster.prefill + cluster.decode:
        faults(sim, None)
        sim.clear()
    yield
    for sim in cluster.prefill + cluster.decode:
        faults(sim, None)
    # let any ejection from this test run out
    assert wait_for(
        lambda: (
            httpx.get(cluster.url + "/ready").json()["pools"]["decode"]["ejected"] == 0
            and httpx.get(cluster.url + "/ready").json()["pools"]["prefill"]["ejected"] == 0
        ),
        timeout=5,
    )


def chat(cluster, content: str = LONG, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)


def test_failed_prefill_is_retried_on_another_prefill_engine(cluster):
    faults(cluster.prefill[0], {"error": {"status": 500}})
    responses = [chat(cluster, f"Case {i}. " + LONG) for i in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert {r.headers["x-pdgate-path"] for r in responses} == {"pd"}
    retried = [r for r in responses if "prefill_retried" in r.headers.get("x-pdgate-failover", "")]
    assert retried, [r.headers for r in responses]


def test_both_prefill_engines_failing_falls_back_to_direct(cluster):
    for sim in cluster.prefill:
        faults(sim, {"error": {"status": 503}})
    r = chat(cluster)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-pdgate-path"] == "direct"
    assert "prefill_fallback_direct" in r.headers["x-pdgate-failover"]
    [dec] = [q for s in cluster.decode for q in s.requests()]
    assert dec["body"].get("kv_transfer_params") is None  # the decode engine prefilled it itself


def test_hanging_prefill_times_out_and_is_retried(cluster):
    faults(cluster.prefill[0], {"hang": {"on": ["prefill"]}})
    results = [chat(cluster, f"Hang {i}. " + LONG) for i in range(2)]
    assert [r.status_code for r in results] == [200, 200]
    assert any("prefill_retried" in r.headers.get("x-pdgate-failover", "") for r in results)


def ejected(cluster, pool: str = "decode") -> int:
    return httpx.get(cluster.url + "/ready").json()["pools"][pool]["ejected"]


def test_decode_failing_before_its_first_byte_is_retried(cluster):
    faults(cluster.decode[0], {"error": {"status": 500}})
    for content in ("short one", LONG):
        assert wait_for(lambda: ejected(cluster) == 0, timeout=5)  # the failing engine gets traffic again
        # Which engine a request lands on follows scraped load, so send until one has met the
        # failing engine (ties rotate: it takes a few at most); every client still gets a 200.
        retried = False
        for i in range(12):
            r = chat(cluster, f"{i} {content}")
            assert r.status_code == 200, r.text
            if "decode_retried" in r.headers.get("x-pdgate-failover", ""):
                retried = True
                break
        assert retried


def test_stream_cut_mid_way_ends_with_an_error_event_never_silently(cluster):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 20}
    whole = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30).json()
    for sim in cluster.decode:  # every stream breaks: the migrated one too
        faults(sim, {"drop": {"after_chunks": 3}})
    rid = f"cut-{time.monotonic_ns()}"
    with httpx.stream(
        "POST",
        cluster.url + "/v1/chat/completions",
        json={**body, "stream": True},
        timeout=30,
        headers={"x-request-id": rid},
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    payloads = [e[6:] for e in events]
    # The error event, then [DONE] (as vLLM ends a failed stream), and [DONE] nowhere else.
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    payloads = payloads[:-1]
    last = orjson.loads(payloads[-1])
    assert last["error"]["type"] == "server_error" or last["error"]["code"], last
    contents = [
        orjson.loads(p)["choices"][0]["delta"].get("content")
        for p in payloads[:-1]
        if "choices" in orjson.loads(p) and orjson.loads(p)["choices"]
    ]
    # What the engines sent (three events, then three more from the engine the answer migrated to),
    # once each and in order: never a duplicated token.
    assert len(contents) <= 6 and whole["choices"][0]["message"]["content"].startswith("".join(contents))
    # The access log says what the client saw: a 200 whose stream ended in an error event, and the
    # tokens it got (its content chunks, less the opening role chunk).
    line = cluster.access_line(rid)
    assert line["status"] == 200 and line["error_status"] == 502 and line["error"]
    assert line["output_tokens"] == len(contents) - 1


def test_ready_says_not_ready_as_soon_as_every_decode_engine_is_gone(tokenizer_dir, tmp_path):
    """No wait for the next health round (an hour away here): /ready probes the decode pool afresh
    when its last probe is older than a quarter second."""
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(THRESHOLD, health={"interval_s": 3600, "timeout_s": 1})
        assert httpx.get(c.url + "/ready").status_code == 200
        c.decode[0].proc.popen.kill()
        c.decode[0].proc.popen.wait(timeout=10)
        time.sleep(HealthChecker.READY_MAX_AGE_S)  # the staleness /ready allows itself (one probe per 0.25 s)
        r = httpx.get(c.url + "/ready", timeout=10)
        assert r.status_code == 503 and r.json()["pools"]["decode"]["healthy"] == 0
    finally:
        group.stop_all()


def test_refused_kv_pull_still_answers(cluster):
    for sim in cluster.prefill:
        faults(sim, {"kv_refuse": {"count": 1}})
    r = chat(cluster, "Refused pull. " + LONG)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert "decode_retried" in r.headers.get("x-pdgate-failover", "")


def test_failing_engine_is_ejected_then_comes_back(cluster):
    bad = cluster.decode[0]
    faults(bad, {"error": {"status": 500}})
    # Requests meet the failing engine as scraped load allows, and an ejection lasts 0.5-1 s here: a
    # loaded machine can let one run out before it is looked at. So: drive it to ejection, then send
    # while it is ejected, and go again if the ejection ran out first.
    sandwiched = 0
    for attempt in range(5):
        for i in range(40):
            assert chat(cluster, f"eject {attempt} {i}").status_code == 200
            if ejected(cluster) == 1:
                break
        # Requests sent while it is ejected (checked before and after each) never reach it.
        for i in range(20):
            seen = len(bad.requests())
            if ejected(cluster) != 1:
                break
            assert chat(cluster, f"while ejected {attempt} {i}").status_code == 200
            if ejected(cluster) == 1:
                sandwiched += 1
                assert len(bad.requests()) == seen
        if sandwiched:
            break
    assert sandwiched >= 1
    faults(bad, None)
    assert wait_for(lambda: ejected(cluster) == 0, timeout=5)
    bad.clear()
    assert wait_for(lambda: chat(cluster, "back?").status_code == 200 and bad.requests() != [], timeout=10)
    metrics = httpx.get(cluster.url + "/metrics").text
    assert sample(metrics, "pdgate_failovers_total", event="decode_retried") >= 1


def test_client_gone_after_prefill_frees_the_prefilled_kv(cluster):
    """The decode leg never answers and the client gives up: the prefill engine's blocks for the
    request are freed at once, not held until the engine's KV lease runs out (30 s)."""

    def held() -> set[str]:  # (earlier tests' refused pulls may still hold theirs until expiry)
        return {rid for s in cluster.prefill for rid in httpx.get(s.url + "/sim/state").json()["held"]}

    before = held()
    for sim in cluster.decode:
        faults(sim, {"hang": {"on": ["decode"]}})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Gone. " + LONG}], "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=1.0)
    assert [q["kind"] for s in cluster.prefill for q in s.requests()] == ["prefill"]
    assert wait_for(lambda: held() <= before, timeout=3)
    assert wait_for(
        lambda: sample(httpx.get(cluster.url + "/metrics").text, "pdgate_requests_total", status="499") >= 1, timeout=3
    )


def test_stream_that_goes_silent_ends_with_a_timeout_event(cluster):
    """An engine that stops sending mid-stream for longer than timeouts.decode_idle_s (1 s here):
    the client gets what was sent, then an error event, not an endless wait. (Every engine here
    goes silent after its first event: the answer migrates once, then ends so.)"""
    for sim in cluster.decode:
        faults(sim, {"slow": {"chunk_delay": 3.0}})
    body = {"model": "tiny", "prompt": "slowly", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        payloads = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    err = orjson.loads(payloads[-2])["error"]
    assert err["code"] == "engine_timeout" and "did not answer in time" in err["message"]
