"""What one client can make the gateway do to others, or learn from it (issue 13's small findings):
no echo of client strings at their own size, no redirects built from the Host header, no secrets
in /admin/config, no Redis address in /ready, one admin token scheme, Retry-After on 503s."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from gateway.config import parse_config
from gateway.http.app import create_app, redacted
from tests.procs import free_port

from .scripted_engine import ScriptedEngine

TOKEN = "hardening-admin-token"


@pytest.fixture(scope="module")
def engine():
    e = ScriptedEngine().start()
    yield e
    e.stop()


def config(tokenizer_dir, engine_url: str, **overrides):
    return parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {"decode": {"endpoints": [engine_url]}},
            "admin": {"token_env": "PDGATE_TEST_ADMIN_TOKEN"},
            **overrides,
        }
    )


@pytest.fixture
def client(tokenizer_dir, engine, monkeypatch):
    monkeypatch.setenv("PDGATE_TEST_ADMIN_TOKEN", TOKEN)
    with TestClient(create_app(config(tokenizer_dir, engine.url))) as c:
        yield c


def test_a_huge_model_name_is_not_echoed_at_its_size(client):
    r = client.post("/v1/completions", json={"model": "m" * 7_000_000, "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(r.content) < 2_000 and "more characters" in r.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/chat/completions/"), ("GET", "/metrics/")])
def test_no_redirect_is_built_from_the_host_header(client, method, path):
    r = client.request(method, path, headers={"host": "evil.example.com"}, json={}, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["message"].endswith("Not Found")


def test_admin_config_shows_no_secrets(tokenizer_dir, engine, monkeypatch):
    monkeypatch.setenv("PDGATE_TEST_ADMIN_TOKEN", TOKEN)
    cfg = config(tokenizer_dir, engine.url, telemetry={"tracing": {"headers": {"Authorization": "Bearer otlp-secret"}}})
    with TestClient(create_app(cfg)) as c:
        r = c.get("/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    assert "otlp-secret" not in r.text
    assert r.json()["config"]["telemetry"]["tracing"]["headers"] == {"Authorization": "<redacted>"}


def test_urls_lose_their_passwords_and_keep_the_rest():
    shown = redacted({"state": {"url": "redis://user:hunter2@redis.internal:6379/0"}, "n": 3})
    assert shown == {"state": {"url": "redis://user:<redacted>@redis.internal:6379/0"}, "n": 3}


def test_ready_names_the_redis_failure_but_not_its_address(tokenizer_dir, engine):
    port = free_port()  # nothing listens there
    cfg = config(
        tokenizer_dir, engine.url, state={"backend": "redis", "url": f"redis://10.255.0.1:{port}/0", "timeout_s": 0.05}
    )
    with TestClient(create_app(cfg)) as c:
        body = c.get("/ready").json()
    state = body["shared_state"]
    assert state["healthy"] is False and state["error"]
    assert str(port) not in str(state) and "10.255.0.1" not in str(state)


@pytest.mark.parametrize(
    ("header", "ok"), [(f"Bearer {TOKEN}", True), (f"bearer {TOKEN}", True), (TOKEN, False), (f"Basic {TOKEN}", False)]
)
def test_the_admin_token_takes_the_bearer_scheme_in_any_case(client, header, ok):
    r = client.get("/admin/config", headers={"authorization": header})
    assert r.status_code == (200 if ok else 401)


def test_no_healthy_engine_says_when_to_retry(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("PDGATE_TEST_ADMIN_TOKEN", TOKEN)
    with TestClient(create_app(config(tokenizer_dir, f"http://127.0.0.1:{free_port()}"))) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


async def test_debug_route_quietly_drops_a_client_gone_while_its_body_is_read(
    tokenizer_dir, engine, caplog, monkeypatch
):
    monkeypatch.setenv("PDGATE_TEST_ADMIN_TOKEN", TOKEN)
    app = create_app(config(tokenizer_dir, engine.url))
    sent: list[dict] = []

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    with TestClient(app) as c:  # runs the lifespan; the request below goes to the ASGI app itself
        state = c.app_state
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/debug/route",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"authorization", f"Bearer {TOKEN}".encode())],
            "state": state,
            "scheme": "http",
            "server": ("test", 80),
        }
        with caplog.at_level(logging.ERROR):
            await app(scope, gone, send)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert sent[0]["status"] == 499


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_below_one_gets_one_message(client, value):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": value})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"max_tokens must be at least 1, got {value}."


def test_a_body_that_is_not_utf8_says_so(client):
    raw = b'{"model":"tiny","prompt":"\xff\xfe"}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    bad_byte = raw.index(b"\xff")
    want = f"The request body is not valid UTF-8 (byte {bad_byte})."
    assert r.status_code == 400 and r.json()["error"]["message"] == want
