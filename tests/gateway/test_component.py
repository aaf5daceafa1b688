"""The gateway's own logic against scripted engines on loopback.

(respx only mocks httpx; the engine legs use the gateway's own HTTP/1.1 client, gateway/engines/h1client.py.)"""

from __future__ import annotations

import orjson
import pytest
from starlette.testclient import TestClient

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.promtext import sample

from .scripted_engine import ScriptedEngine

THRESHOLD = 64
KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "e-1",
    "remote_request_id": "r-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "some_future_field": {"x": 1},
}
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
LONG = "def handler(request):\n    return request.body\n" * 40  # well over THRESHOLD tokens
# What a migratable non-streamed request's decode leg adds to the client's body (docs/operations.md,
# "Mid-stream migration"): the engine streams, with the generated token ids, and the gateway
# assembles the whole answer.
MIGRATABLE = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def completion(text="ok", kv=None):
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "kv_transfer_params": kv,
    }


@pytest.fixture(scope="module")
def engines():
    prefill, decode = ScriptedEngine().start(), ScriptedEngine().start()
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture
def prefill(engines):
    engines[0].reset()
    return engines[0]


@pytest.fixture
def decode(engines):
    engines[1].reset()
    return engines[1]


@pytest.fixture(scope="module")
def client(tokenizer_dir, engines):
    cfg = parse_config(
        {
            "server": {"max_body_bytes": 20000},
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {"prefill": {"endpoints": [engines[0].url]}, "decode": {"endpoints": [engines[1].url]}},
            # Stateless routing: these tests are about the handshake, so a repeated prompt must not go
            # direct because the prefix index remembers it.
            "routing": {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}},
        }
    )
    with TestClient(create_app(cfg)) as c:
        yield c


def test_short_prompt_goes_direct(client, prefill, decode):
    decode.reply("/v1/completions", completion("hi"))
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200
    assert r.headers["x-pdgate-path"] == "direct"
    assert r.json()["choices"][0]["text"] == "hi"
    [sent] = decode.posts("/v1/completions")
    # A short whole answer (routing.migration.non_streaming_min_tokens): sent as the client sent it
    assert sent.body == {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    assert prefill.requests == []


def test_long_prompt_runs_the_nixl_handshake(client, prefill, decode):
    prefill.reply("/v1/completions", completion("x", kv=KV))
    decode.reply("/v1/completions", completion("decoded"))
    sent = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 100,  # past routing.migration.non_streaming_min_tokens: migratable
        "min_tokens": 5,
        "stream": False,
        "stream_options": None,
        "vllm_extension": {"keep": True},
    }
    r = client.post("/v1/completions", json=sent)
    assert r.status_code == 200, r.text
    assert r.headers["x-pdgate-path"] == "pd"
    [pre_leg] = prefill.posts("/v1/completions")
    [dec_leg] = decode.posts("/v1/completions")
    pre, dec = pre_leg.body, dec_leg.body
    # prefill leg: one token, not streamed, no min_tokens/stream_options, asks for remote decode
    assert pre == {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 1,
        "stream": False,
        "vllm_extension": {"keep": True},
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    # decode leg: the client's body as sent, plus the prefill's params verbatim (and, for a
    # migratable request, streamed with its token ids)
    assert dec == {**sent, **MIGRATABLE, "kv_transfer_params": KV}
    assert pre_leg.headers["x-request-id"] == dec_leg.headers["x-request-id"] == r.headers["x-request-id"]
    assert r.json()["choices"][0]["text"] == "decoded"


def test_chat_max_completion_tokens_is_one_on_prefill(client, prefill, decode):
    prefill.reply("/v1/chat/completions", completion(kv=KV))
    decode.reply("/v1/chat/completions", completion())
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "max_completion_tokens": 30, "messages": [{"role": "user", "content": LONG}]},
    )
    assert r.headers["x-pdgate-path"] == "pd"
    [pre] = [r.body for r in prefill.posts("/v1/chat/completions")]
    [dec] = [r.body for r in decode.posts("/v1/chat/completions")]
    assert pre["max_completion_tokens"] == 1 and pre["max_tokens"] == 1
    assert dec["max_completion_tokens"] == 30 and "max_tokens" not in dec


@pytest.mark.parametrize("prompt", ["short", LONG])
def test_client_kv_transfer_params_never_reach_an_engine(client, prefill, decode, prompt):
    prefill.reply("/v1/completions", completion(kv=KV))
    decode.reply("/v1/completions", completion())
    evil = {
        "do_remote_prefill": True,
        "remote_host": "169.254.169.254",
        "remote_port": 80,
        "remote_engine_id": "x",
        "remote_block_ids": [[1]],
    }
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "kv_transfer_params": evil})
    assert r.status_code == 200
    sent = prefill.requests + decode.requests
    assert len(sent) == (2 if prompt == LONG else 1)
    for leg in sent:
        assert "169.254.169.254" not in orjson.dumps(leg.body).decode()
        assert leg.body.get("kv_transfer_params") in (None, KV, {**PREFILL_KV})


def test_prefill_without_kv_params_falls_back_to_direct(client, prefill, decode):
    """A prefill engine without a KV connector is misconfigured: the request is still served (the
    decode engine prefills), the response says so, and the log names the cause."""
    prefill.reply("/v1/completions", completion(kv=None))
    decode.reply("/v1/completions", completion("served"))
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": LONG})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "served"
    assert r.headers["x-pdgate-path"] == "direct" and r.headers["x-pdgate-failover"] == "prefill_fallback_direct"
    assert decode.requests[0].body.get("kv_transfer_params") is None


def test_prefill_without_kv_params_is_a_clear_502_without_fallback(tokenizer_dir, engines):
    prefill, decode = engines
    prefill.reset()
    decode.reset()
    cfg = parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {"prefill": {"endpoints": [prefill.url]}, "decode": {"endpoints": [decode.url]}},
            "routing": {"decider": {"name": "token_threshold", "threshold": THRESHOLD}, "prefix": {"enabled": False}},
            "failover": {"fallback_to_direct": False},
        }
    )
    prefill.reply("/v1/completions", completion(kv=None))
    with TestClient(create_app(cfg)) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": LONG})
    assert r.status_code == 502 and "x-pdgate-path" not in r.headers
    assert "kv_transfer_params" in r.json()["error"]["message"]
    assert decode.requests == []


def test_engine_errors(client, decode):
    decode.reply(
        "/v1/completions",
        {"error": {"message": "temperature is bad", "type": "BadRequestError", "code": 400}},
        status=400,
    )
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "temperature is bad"
    decode.reply("/v1/completions", status=500, raw=b"boom")
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"] and "boom" not in r.text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": "nope", "prompt": "x"}', 404, "does not exist"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
        (b'{"model": "tiny", "prompt": {"a": 1}}', 400, "prompt"),
        (b'{"model": "tiny", "prompt": "' + b"word " * 3000 + b'"}', 400, "maximum context length"),
        (b'{"model": "tiny", "prompt": "' + b"x" * 30000 + b'"}', 413, "larger than"),
    ],
)
def test_bad_input_gets_a_clear_error_and_no_upstream_call(client, prefill, decode, body, status, needle):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert prefill.requests == decode.requests == []


def test_bad_chat_input(client, prefill, decode):
    for body, needle in [
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"content": "x"}]}, "role"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "content"),
    ]:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], body
    assert prefill.requests == decode.requests == []


def test_models_and_metrics(client, decode):
    decode.reply("/v1/completions", completion())
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"

    def count(**labels):
        return sample(client.get("/metrics").text, "pdgate_requests_total", **labels)

    ok, unknown = count(model="tiny", path="direct", status="200"), count(path="none", status="404")
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert count(model="tiny", path="direct", status="200") == ok + 1
    # a name a client made up never becomes a label value (unbounded cardinality)
    assert count(model="unknown", path="none", status="404") == unknown + 1


def test_unknown_routes_answer_in_openai_shape(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "Not Found" in r.json()["error"]["message"]
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_chunked_body_over_the_limit_is_413(client, prefill, decode):
    def chunks():
        for _ in range(30):
            yield b" " * 1000  # 30 kB, no Content-Length

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and prefill.requests == decode.requests == []


def test_deep_nesting_is_a_clear_400(client, prefill, decode):
    deep = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 300 + b"]" * 300 + b"}"
    r = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert prefill.requests == decode.requests == []


def test_prompt_tokens_header(client, decode):
    decode.reply("/v1/completions", completion())
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7]})
    assert r.headers["x-pdgate-prompt-tokens"] == "3"


def _app(tokenizer_dir, decode_urls, **routing):
    return create_app(
        parse_config(
            {
                "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
                "pools": {"decode": {"endpoints": decode_urls}},
                "health": {"interval_s": 60},
                **({"routing": routing} if routing else {}),
            }
        )
    )


def test_not_ready_without_a_healthy_decode_endpoint(tokenizer_dir):
    from tests.procs import free_port

    with TestClient(_app(tokenizer_dir, [f"http://127.0.0.1:{free_port()}"])) as c:
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["pools"]["decode"] == {"healthy": 0, "ejected": 0, "total": 1}
        assert "discovery" not in r.json()  # no pool follows EndpointSlices
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_endpoint"


def test_a_gateway_bug_still_answers_in_openai_shape(tokenizer_dir, engines, monkeypatch):
    from policies import registry

    class Broken:
        def decide(self, ctx, decode, prefill):
            raise RuntimeError("bug")

    class EntryPoint:
        name = "broken"

        def load(self):
            return Broken

    monkeypatch.setattr(registry, "entry_points", lambda group: [EntryPoint()])
    with TestClient(_app(tokenizer_dir, [engines[1].url], decider={"name": "broken"})) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert sample(c.get("/metrics").text, "pdgate_requests_total", status="500") == 1


def test_a_third_party_policy_gets_the_lifecycle_hooks(tokenizer_dir, engines, monkeypatch):
    """A policy from the ``pdgate.policies`` entry points learns through the same hooks as the
    gateway's own learners: it defines them, the gateway calls them."""
    from policies import registry

    seen: list[tuple[str, str]] = []

    class Remembering:  # a scorer that learns which engine answered
        def score(self, ctx, candidates):
            return [0.0] * len(candidates)

        def on_routed(self, ctx, decision):
            seen.append(("routed", decision.decode.url))

        def on_leg_done(self, ctx, leg):
            seen.append((f"{leg.leg} {leg.outcome.value}", leg.url))

        def on_finished(self, ctx, decision, result):
            seen.append(("finished", str(result.status)))

    class EntryPoint:
        name = "remembering"

        def load(self):
            return Remembering

    monkeypatch.setattr(registry, "entry_points", lambda group: [EntryPoint()])
    engines[1].reset()
    engines[1].reply("/v1/completions", completion("hi"))
    with TestClient(_app(tokenizer_dir, [engines[1].url], decode={"scorers": [{"name": "remembering"}]})) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 200
    assert seen == [("routed", engines[1].url), ("decode ok", engines[1].url), ("finished", "200")]


def test_middleware_added_to_the_app_sees_inference_traffic(tokenizer_dir, engines):
    """The inference routes are in Starlette's route table: an operator's middleware (auth, audit,
    rate limits) wraps them like any other route."""
    seen: list[str] = []

    class Audit:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                seen.append(f"{scope['method']} {scope['path']}")
            await self.app(scope, receive, send)

    engines[1].reset()
    engines[1].reply("/v1/chat/completions", completion("hi"))
    app = _app(tokenizer_dir, [engines[1].url])
    app.add_middleware(Audit)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
    assert seen == ["POST /v1/chat/completions"]


@pytest.fixture(scope="module")
def limited(tokenizer_dir, engines):
    """A gateway with an output limit of 100 tokens per request and the default caps."""
    cfg = parse_config(
        {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {"decode": {"endpoints": [engines[1].url]}},
            "limits": {"max_output_tokens": 100},
        }
    )
    with TestClient(create_app(cfg)) as c:
        yield c


def test_engine_receives_the_output_share_when_none_was_asked(limited, decode):
    decode.reply("/v1/chat/completions", completion())
    decode.reply("/v1/completions", completion())
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 4}
    assert limited.post("/v1/chat/completions", json=chat).status_code == 200
    assert limited.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 10}).status_code == 200
    [sent_chat] = decode.posts("/v1/chat/completions")
    [sent_cmpl] = decode.posts("/v1/completions")
    assert sent_chat.body == {**chat, "max_completion_tokens": 25}  # 100 tokens / 4 sequences
    assert sent_cmpl.body == {"model": "tiny", "prompt": ["a", "b"], "n": 10, "max_tokens": 5}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 100, "n": 50}, "n", "n_too_large"),
        ({"max_tokens": 100, "n": 2}, "max_tokens", "max_tokens_too_large"),
        ({"min_tokens": 101}, "min_tokens", "min_tokens_too_large"),
        ({"n": 100000}, "n", "n_too_large"),
        ({"prompt": ["p"] * 65}, "prompt", "too_many_prompts"),
    ],
)
def test_a_request_over_a_cap_never_reaches_an_engine(limited, decode, body, param, code):
    r = limited.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert decode.requests == []
