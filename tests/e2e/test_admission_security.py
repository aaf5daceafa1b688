"""End to end: API keys, request limits and admission control (queue, then 429 with Retry-After)."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import openai
import pytest
import yaml

from tests.procs import ProcGroup, wait_for

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY = "sk-test-key-1"
ADMIN = "admin-token-x"


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(f"# client keys\n{KEY}\nsk-other-key\n")
    (group.log_dir / "admin").write_text(ADMIN)
    try:
        c.decode.append(c.start_sim("decode", "--decode-time-per-token", "0.02"))
        c.start_gateway(
            10_000,
            auth={"api_keys_file": str(group.log_dir / "keys")},
            admin={"token_file": str(group.log_dir / "admin")},
            limits={"max_output_tokens": 100, "max_prompt_tokens": 300, "max_header_bytes": 4096},
        )
        yield c
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def clean(cluster):
    cluster.decode[0].clear()


def post(cluster, body: dict, key: str | None = KEY, **headers) -> httpx.Response:
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def body(content: str = "hi", **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def reconfigure(cluster, **changes) -> None:
    cfg = copy.deepcopy(cluster.config)
    cfg.update(changes)
    cluster.config_path.write_text(yaml.safe_dump(cfg))
    cluster.config = cfg
    want = changes.get("admission", {})
    assert wait_for(
        lambda: (
            httpx.get(cluster.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}).json()["config"][
                "admission"
            ]
            | want
            == httpx.get(cluster.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}).json()["config"][
                "admission"
            ]
        ),
        timeout=15,
    )


def test_api_keys(cluster):
    with (
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="sk-wrong", max_retries=0) as bad,
        openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0) as good,
    ):
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert (
            good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            .choices[0]
            .message.content
        )
        assert [m.id for m in good.models.list()] == ["tiny"]
    assert post(cluster, body(), key=None).status_code == 401
    assert post(cluster, body(), key="sk-other-key").status_code == 200
    assert httpx.get(cluster.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(cluster.url + "/ready").status_code == 200
    assert len(cluster.decode[0].requests()) == 2  # only the accepted ones reached the engine


@pytest.mark.parametrize(
    ("kw", "status", "code"),
    [
        ({"max_tokens": 101}, 400, "max_tokens_too_large"),
        ({"content": "many words here " * 200}, 400, "prompt_too_long"),
        ({"headers": {"x-padding": "p" * 5000}}, 431, "headers_too_large"),
    ],
    ids=["max_tokens", "prompt_tokens", "header_bytes"],
)
def test_limits_refuse_before_any_engine(cluster, kw, status, code):
    headers = kw.pop("headers", {})
    r = post(cluster, body(**kw), **headers)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert cluster.decode[0].requests() == []


def hold(cluster, seconds_of_tokens: int, results: list[int]) -> threading.Thread:
    """A request that keeps the decode engine busy (0.02 s per token)."""

    def run() -> None:
        results.append(post(cluster, body("keep busy", max_tokens=seconds_of_tokens * 50, ignore_eos=True)).status_code)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert wait_for(lambda: cluster.decode[0].requests(), timeout=10)
    return t


def test_per_engine_limit_queues_then_429(cluster):
    reconfigure(
        cluster,
        admission={"max_per_decode_endpoint": 1, "queue_timeout_s": 0.3, "retry_after_s": 2},
        limits={"max_output_tokens": 1000, "max_prompt_tokens": 300, "max_header_bytes": 4096},
    )
    results: list[int] = []
    t = hold(cluster, 2, results)
    t0 = time.monotonic()
    r = post(cluster, body())
    waited = time.monotonic() - t0
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and waited >= 0.3
    t.join(timeout=30)
    assert results == [200]
    assert post(cluster, body()).status_code == 200  # capacity is back


def test_queued_request_is_served_when_capacity_frees(cluster):
    reconfigure(
        cluster,
        admission={"max_per_decode_endpoint": 1, "queue_timeout_s": 20},
        limits={"max_output_tokens": 1000, "max_prompt_tokens": 300, "max_header_bytes": 4096},
    )
    results: list[int] = []
    t = hold(cluster, 1, results)
    r = post(cluster, body())
    assert r.status_code == 200  # it waited for the first request to finish, then ran
    t.join(timeout=30)
    assert results == [200]
    first, second = sorted(cluster.decode[0].requests(), key=lambda q: q["received_at"])
    assert second["received_at"] >= first["finished_at"]  # it reached the engine only once the first was done


def test_overall_limit(cluster):
    reconfigure(
        cluster,
        admission={"max_in_flight": 1, "queue_timeout_s": 0.2},
        limits={"max_output_tokens": 1000, "max_prompt_tokens": 300, "max_header_bytes": 4096},
    )
    results: list[int] = []
    t = hold(cluster, 2, results)
    r = post(cluster, body())
    assert r.status_code == 429 and "too many requests in flight" in r.json()["error"]["message"]
    t.join(timeout=30)
    assert results == [200] and post(cluster, body()).status_code == 200
    reconfigure(cluster, admission={"max_in_flight": 0})
