"""End to end: routing on real signals (prefix index, engine load), explained decisions, and live
config reloads, with the real gateway process in front of simulated engines."""

from __future__ import annotations

import copy
import threading

import httpx
import pytest
import yaml

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
TOKEN = "test-admin-token"
LONG = "Answer from this report: " + "the prefill pool computes the prompt and the decode pool streams. " * 40


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    token_file = group.log_dir / "admin-token"
    token_file.write_text(TOKEN + "\n")
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode += [
            c.start_sim("decode", "--decode-time-per-token", "0.01"),
            c.start_sim("decode", "--decode-time-per-token", "0.01"),
        ]
        c.start_gateway(
            THRESHOLD,
            admin={"token_file": str(token_file)},
            signals={"scrape_interval_s": 0.2, "scrape_timeout_s": 2.0, "max_age_s": 5.0},
        )
        yield c
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def clean(cluster):
    for sim in cluster.prefill + cluster.decode:
        sim.clear()


def chat(cluster, content: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def engine_of(cluster, request_id: str) -> tuple[str | None, str]:
    """(prefill engine url or None, decode engine url) that served the request."""

    def served(sims):
        return [s.url for s in sims for r in s.requests() if r["headers"].get("x-request-id") == request_id]

    prefill, decode = served(cluster.prefill), served(cluster.decode)
    assert len(decode) == 1 and len(prefill) <= 1
    return (prefill[0] if prefill else None), decode[0]


def admin(cluster, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, cluster.url + path, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30, **kw)


def rewrite_config(cluster, **changes) -> None:
    cfg = copy.deepcopy(cluster.config)
    cfg.update(changes)
    tmp = cluster.config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg))
    tmp.replace(cluster.config_path)
    cluster.config = cfg


def set_threshold(cluster, threshold: int) -> str:
    rewrite_config(cluster, routing={"decider": {"name": "token_threshold", "threshold": threshold}})
    assert wait_for(
        lambda: (
            admin(cluster, "GET", "/admin/config").json()["config"]["routing"]["decider"].get("threshold") == threshold
        ),
        timeout=15,
    )
    return admin(cluster, "GET", "/admin/config").json()["version"]


def test_repeated_long_prompt_goes_back_to_its_decode_engine_and_direct(cluster):
    prompt = "Case one. " + LONG
    first = chat(cluster, prompt)
    assert first.headers["x-pdgate-path"] == "pd"
    _, home = engine_of(cluster, first.headers["x-request-id"])
    for _ in range(3):
        again = chat(cluster, prompt)
        assert again.headers["x-pdgate-path"] == "direct"
        assert engine_of(cluster, again.headers["x-request-id"]) == (None, home)
    # the same document under another question shares the cached prefix: direct, same engine
    shared = chat(cluster, prompt + " And a follow-up question?")
    assert shared.headers["x-pdgate-path"] == "direct"
    assert engine_of(cluster, shared.headers["x-request-id"]) == (None, home)
    # a different long prompt is not cached anywhere: P/D again
    assert chat(cluster, "Another topic entirely. " + LONG).headers["x-pdgate-path"] == "pd"


def test_debug_route_explains_without_running(cluster):
    prompt = "Case two. " + LONG
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    r = admin(cluster, "POST", "/debug/route", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["path"] == "pd" and plan["reason"] == "long_uncached"
    assert plan["detail"].startswith(f"uncached={plan['prompt_tokens']}>={THRESHOLD}")
    assert plan["decode"] in [s.url for s in cluster.decode] and plan["prefill"] == cluster.prefill[0].url
    steps = plan["trace"]["decode"]
    assert steps[0] == {"filter": "bounded_load", "kept": [s.url for s in cluster.decode]}  # all idle
    assert [step.get("scorer") for step in steps[1:3]] == ["prefix_affinity", "load"]
    assert all(s.requests() == [] for s in cluster.prefill + cluster.decode)  # nothing ran
    # nothing was learned either: the real request still goes P/D
    assert chat(cluster, prompt).headers["x-pdgate-path"] == "pd"
    # after it, the explanation names the cached prefix
    plan = admin(cluster, "POST", "/debug/route", json=body).json()
    assert plan["path"] == "direct" and plan["reason"] == "prefix_cached"
    assert max(plan["cached_tokens"].values()) >= plan["prompt_tokens"] - plan["block_size"]


def test_admin_and_debug_need_the_token(cluster):
    body = {"model": "tiny", "prompt": "x"}
    assert httpx.post(cluster.url + "/debug/route", json=body).status_code == 401
    r = httpx.get(cluster.url + "/admin/config", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"


def test_load_shifts_traffic_away_from_a_busy_engine(cluster):
    """Another client keeps decode 0 busy with long streams sent to it directly: the gateway sees
    it only through the engine's scraped metrics, and sends its own requests to decode 1."""
    busy, idle = cluster.decode
    stop = threading.Event()

    def hog() -> None:
        body = {"model": "tiny", "prompt": "keep busy", "max_tokens": 400, "ignore_eos": True}
        while not stop.is_set():
            httpx.post(busy.url + "/v1/completions", json=body, timeout=60)

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(4)]
    for t in hogs:
        t.start()
    try:
        assert wait_for(lambda: sample(busy.metrics(), "vllm:num_requests_running") >= 3, timeout=10)

        def gateway_sees_busy() -> bool:  # the scraped engine stats, as the policies get them
            plan = admin(cluster, "POST", "/debug/route", json={"model": "tiny", "prompt": "x"}).json()
            views = {e["url"]: e for e in plan["endpoints"]}
            return (views[busy.url]["running"] or 0) >= 3 and views[idle.url]["running"] == 0

        assert wait_for(gateway_sees_busy, timeout=10)
        served = [engine_of(cluster, chat(cluster, f"short question {i}").headers["x-request-id"])[1] for i in range(8)]
        assert served == [idle.url] * 8
    finally:
        stop.set()
        for t in hogs:
            t.join(timeout=30)


def test_yaml_edit_changes_the_threshold_live_without_failing_a_request(cluster):
    prompt = "Medium sized question about pools. " * 6
    n = int(chat(cluster, prompt).headers["x-pdgate-prompt-tokens"])
    assert THRESHOLD - 20 > n > 40
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=30) as c:
            i = 0
            while not stop.is_set():
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"ping {i}"}], "max_tokens": 2}
                statuses.append(c.post(cluster.url + "/v1/chat/completions", json=body).status_code)
                i += 1

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        # A fresh prompt of the same length each time: no cached prefix gets in the way.
        set_threshold(cluster, 40)
        assert chat(cluster, "Fresh " + prompt).headers["x-pdgate-path"] == "pd"
        set_threshold(cluster, THRESHOLD)
        assert chat(cluster, "Other " + prompt).headers["x-pdgate-path"] == "direct"
    finally:
        stop.set()
        t.join(timeout=30)
    assert statuses and set(statuses) == {200}
    reloads = sample(httpx.get(cluster.url + "/metrics").text, "pdgate_config_reloads_total", result="ok")
    assert reloads >= 2


def test_invalid_edit_changes_nothing(cluster):
    before = admin(cluster, "GET", "/admin/config").json()
    rejected = sample(httpx.get(cluster.url + "/metrics").text, "pdgate_config_reloads_total", result="rejected")
    rewrite_config(cluster, routing={"decider": {"name": "token_threshold", "threshold": -5}})
    assert wait_for(
        lambda: (
            sample(httpx.get(cluster.url + "/metrics").text, "pdgate_config_reloads_total", result="rejected")
            == rejected + 1
        ),
        timeout=15,
    )
    after = admin(cluster, "GET", "/admin/config").json()
    assert after["version"] == before["version"] and after["config"] == before["config"]
    assert "threshold" in after["last_reload_error"]
    assert "routing.decider" in cluster.gateway.log_tail() or "threshold" in cluster.gateway.log_tail()
    assert chat(cluster, "Case three. " + LONG).headers["x-pdgate-path"] == "pd"
    # restore a valid file for whatever runs next
    rewrite_config(cluster, routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}})
    assert wait_for(lambda: admin(cluster, "GET", "/admin/config").json()["last_reload_error"] is None, timeout=15)


def test_debug_route_takes_completion_bodies_too(cluster):
    r = admin(cluster, "POST", "/debug/route", json={"model": "tiny", "prompt": "hello there"})
    assert r.status_code == 200 and r.json()["path"] == "direct" and r.json()["reason"] == "short_prompt"
    r = admin(cluster, "POST", "/debug/route", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
