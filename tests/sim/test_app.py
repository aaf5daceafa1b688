"""The app's vLLM routes in-process (sim.app, httpx's ASGI transport); the generation routes are
test_generate.py, their streams test_streaming.py."""

from __future__ import annotations

import contextlib

import httpx

from engine_model.config import SimConfig
from sim.app import create_app


@contextlib.asynccontextmanager
async def client(**kw):
    app = create_app(SimConfig(**kw))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
            yield c


async def test_render_routes_answer_like_vllm():
    async with client(model="m", role="prefill") as c:
        r = await c.post("/v1/completions/render", json={"model": "m", "prompt": [11, 12, 13], "max_tokens": 5})
        assert r.status_code == 200
        (gen,) = r.json()  # completions: a list of GenerateRequest, one per prompt
        assert set(gen) == {
            "request_id", "token_ids", "features", "sampling_params", "model", "stream", "stream_options",
            "cache_salt", "priority", "kv_transfer_params",
        }  # fmt: skip
        assert gen["request_id"].startswith("cmpl-") and gen["token_ids"] == [11, 12, 13]
        assert gen["sampling_params"]["max_tokens"] == 5 and gen["kv_transfer_params"] is None
        r = await c.post("/v1/completions/render", json={"prompt": ["abcd", "efghijkl"]})
        assert [len(g["token_ids"]) for g in r.json()] == [1, 2]  # 4 bytes per token without a tokenizer
        # Chat: one GenerateRequest; kv_transfer_params in the body is not an error on any role.
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": {"do_remote_prefill": True},
        }
        r = await c.post("/v1/chat/completions/render", json=body)
        gen = r.json()
        assert r.status_code == 200 and gen["request_id"].startswith("chatcmpl-")
        assert gen["stream"] is True and gen["stream_options"] == {"include_usage": True}
        assert gen["token_ids"] and gen["kv_transfer_params"] is None
        # Errors as vLLM's: an unknown model is 404, nothing is recorded as a generation request.
        r = await c.post("/v1/completions/render", json={"model": "other", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = await c.post("/v1/completions/render", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 400
        assert (await c.get("/sim/requests")).json()["requests"] == []
