"""The generation routes in-process (sim.generate, httpx's ASGI transport): body checks, late
errors, batches, response shapes and records, rejected decode legs; details that need no processes."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from engine_model.config import SimConfig
from sim.app import create_app


@contextlib.asynccontextmanager
async def client(**kw):
    app = create_app(SimConfig(**kw))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
            yield c


def events(text: str) -> list:
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in text.split("\n\n") if e]


async def test_body_checks():
    async with client() as c:
        r = await c.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]
        r = await c.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json() == {"error": {  # byte for byte what vLLM 0.32 answered
            "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', "
                       "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double "
                       "quotes'}}",
            "type": "Bad Request", "param": "body.1", "code": 400}}  # fmt: skip
        r = await c.post("/v1/completions", json=[1, 2])
        assert r.status_code == 400
        r = await c.get("/v1/completions")
        assert r.status_code == 405
        recs = (await c.get("/sim/requests")).json()["requests"]
        assert [x["status"] for x in recs] == ["failed"] * 3 and recs[1]["body"] is None
        assert recs[2]["body"] == [1, 2] and recs[0]["http_status"] == 400


async def test_empty_token_prompt_fails_late_like_vllm():
    async with client() as c:
        r = await c.post("/v1/completions", json={"prompt": [], "stream": True})
        assert r.status_code == 400 and r.json()["error"]["message"] == "You must pass at least one prompt"
        r = await c.post("/v1/completions", json={"prompt": [[]]})
        assert r.status_code == 400 and r.json()["error"]["message"] == "The decoder prompt cannot be empty"
        r = await c.post("/v1/completions", json={"prompt": [[]], "stream": True})
        assert r.status_code == 200
        assert r.text == (
            'data: {"error": {"message": "The decoder prompt cannot be empty", "type": "BadRequestError", '
            '"param": null, "code": 400}}\n\ndata: [DONE]\n\n'
        )


async def test_batches_n_stop_and_token_ids():
    async with client() as c:
        out = (await c.post("/v1/completions", json={"prompt": ["one", "two"], "n": 2, "max_tokens": 3})).json()
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
        texts = [ch["text"] for ch in out["choices"]]
        assert len(set(texts)) == 4 and out["usage"]["completion_tokens"] == 12
        assert out["usage"]["prompt_tokens"] == 2  # "one", "two": 1 token each (4 bytes per token)
        single = (await c.post("/v1/completions", json={"prompt": "two", "max_tokens": 3})).json()
        assert single["choices"][0]["text"] == texts[2]  # choice 0 of a prompt does not depend on the batch
        batch = {"prompt": ["one", "two"], "n": 2, "max_tokens": 3, "stream": True}
        stream = await c.post("/v1/completions", json=batch)
        evs = events(stream.text)
        assert {e["choices"][0]["index"] for e in evs[:-1]} == {0, 1, 2, 3}
        # stop strings: cut the text, finish_reason "stop", stop_reason = the string
        full = (await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12})).json()["choices"][0]
        word = full["text"].split()[3]
        cut = (await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "stop": [word]})).json()
        ch = cut["choices"][0]
        assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", word)
        assert full["text"].startswith(ch["text"]) and word not in ch["text"]
        # min_tokens keeps a stop condition from firing early
        first = full["text"].split()[0]
        kept = (await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "stop": [first],
                                                     "min_tokens": 12})).json()  # fmt: skip
        assert kept["choices"][0]["finish_reason"] == "length"
        with_ids = {"prompt": [3, 4], "max_tokens": 2, "return_token_ids": True}
        ids = (await c.post("/v1/completions", json=with_ids)).json()
        assert ids["choices"][0]["prompt_token_ids"] == [3, 4] and len(ids["choices"][0]["token_ids"]) == 2


async def test_chat_response_shape_and_records():
    async with client(model="m") as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2},
            headers={"X-Request-Id": "abc"},
        )
        out = r.json()
        assert list(out) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                             "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                             "ec_transfer_params", "metrics"]  # fmt: skip
        assert out["id"] == "chatcmpl-abc" and out["object"] == "chat.completion"
        [choice] = out["choices"]
        assert list(choice) == ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                "routed_experts"]  # fmt: skip
        assert list(choice["message"]) == ["role", "content", "refusal", "annotations", "audio", "function_call",
                                           "reasoning"]  # fmt: skip
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert "x-request-id" not in r.headers
        [rec] = (await c.get("/sim/requests")).json()["requests"]
        assert rec["request_id"] == "abc" and rec["headers"]["x-request-id"] == "abc"
        assert rec["endpoint"] == "/v1/chat/completions" and rec["kind"] == "plain" and rec["status"] == "completed"
        assert rec["internal_ids"][0].startswith("chatcmpl-abc-") and rec["finish_reasons"] == ["length"]
        assert rec["received_at"] <= rec["first_token_at"] <= rec["finished_at"]
        await c.delete("/sim/requests")
        assert (await c.get("/sim/requests")).json()["requests"] == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_decode_leg_rejected_before_the_engine_releases_the_prefill_blocks(path):
    async with client(role="prefill", engine_id="P") as p, client(role="decode") as d:
        body = {"prompt": "hello there", "messages": [{"role": "user", "content": "hello there"}]}
        pre = await p.post(path, json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        kv = pre.json()["kv_transfer_params"]
        state = (await p.get("/sim/state")).json()
        assert len(state["held"]) == 1
        r = await d.post(path, json={**body, "model": "other", "kv_transfer_params": kv})
        assert r.status_code == 404
        for _ in range(100):
            if not (await p.get("/sim/state")).json()["held"]:
                break
            await asyncio.sleep(0.01)
        assert (await p.get("/sim/state")).json()["held"] == {}
