"""Dynamic LoRA loading against an engine stand-in speaking vLLM's admin endpoints: one load per
engine and adapter however many requests wait for it, bounded in time, failures as 503 messages,
and the least recently used adapter unloaded past the per-engine bound."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.adapters.catalogue import Adapter
from gateway.adapters.loader import AdapterLoader, AdapterUnavailable
from gateway.config import LoraConfig
from gateway.engines.pools import Pools

A = Adapter("adpA", "tiny", "/adapters/adpA", configured=True)
B = Adapter("adpB", "tiny", "/adapters/adpB", configured=True)
C = Adapter("adpC", "tiny", "/adapters/adpC", configured=True)


class Engine:
    """vLLM 0.32's /v1/load_lora_adapter and /v1/unload_lora_adapter, as the research notes them."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.load_calls = 0
        self.delay = 0.0
        self.fail: tuple[int, str] | None = None
        self.fail_body: bytes | None = None  # an error answer's body as it is (status from ``fail``)

    async def serve(self) -> str:
        async def load(request: web.Request) -> web.Response:
            body = await request.json()
            self.load_calls += 1
            await asyncio.sleep(self.delay)
            if self.fail is not None:
                status, message = self.fail
                error = {"error": {"message": message, "type": "NotFoundError", "param": None, "code": status}}
                raw = self.fail_body if self.fail_body is not None else orjson.dumps(error)
                return web.Response(status=status, body=raw, content_type="application/json")
            if body["lora_name"] in self.loaded:
                msg = f"The lora adapter '{body['lora_name']}' has already been loaded."
                return web.json_response(
                    {"error": {"message": msg, "type": "InvalidUserInput", "code": 400}}, status=400
                )
            self.loaded[body["lora_name"]] = body["lora_path"]
            return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

        async def unload(request: web.Request) -> web.Response:
            name = (await request.json())["lora_name"]
            if self.loaded.pop(name, None) is None:
                return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/v1/unload_lora_adapter", unload)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def setup():
    engine = Engine()
    url = await engine.serve()
    pools = Pools([], [url])
    async with aiohttp.ClientSession() as session:
        yield engine, pools, session
    await engine.runner.cleanup()


def _loader(pools, session, **kw) -> AdapterLoader:
    return AdapterLoader(pools, session, LoraConfig(dynamic_loading=True, **kw))


async def test_concurrent_requests_for_an_adapter_wait_for_one_load(setup):
    engine, pools, session = setup
    engine.delay = 0.2
    loader = _loader(pools, session)
    ep = pools.decode[0]
    reports = await asyncio.gather(*(loader.ensure([ep], A) for _ in range(5)))
    assert engine.load_calls == 1 and engine.loaded == {"adpA": "/adapters/adpA"}
    assert sorted(r[0].result for r in reports) == ["joined"] * 4 + ["loaded"]
    assert "adpA" in ep.served_models and ep.adapters["adpA"] == ("/adapters/adpA", "tiny")
    assert await loader.ensure([ep], A) == []  # listed now: nothing to wait for
    assert loader.loads["ok"] == 1


async def test_a_load_that_fails_is_a_clear_error_and_the_next_request_tries_again(setup):
    engine, pools, session = setup
    engine.fail = (404, "Loading lora adpA failed: No adapter found for /adapters/adpA")
    loader = _loader(pools, session)
    ep = pools.decode[0]
    with pytest.raises(AdapterUnavailable, match=r"could not be loaded .* No adapter found"):
        await loader.ensure([ep], A)
    assert loader.loads["failed"] == 1 and not ep.served_models
    engine.fail = None
    await loader.ensure([ep], A)
    assert engine.loaded == {"adpA": "/adapters/adpA"}


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (b'{"error":"engine out of LoRA slots"}', "engine out of LoRA slots"),  # a bare string
        (b'{"error":null}', '{"error":null}'),  # no message: the body as it is
        (b'{"error":{"message":5}}', '{"error":{"message":5}}'),
        (b"[1]", "[1]"),
        (b'{"detail":"Internal Server Error"}', "Internal Server Error"),
    ],
)
async def test_a_failed_load_with_any_error_body_is_a_clear_error(setup, body, shown):
    """Whatever the engine's error body, the request gets AdapterUnavailable (its 503), never another
    exception (a 500)."""
    engine, pools, session = setup
    engine.fail, engine.fail_body = (500, ""), body
    loader = _loader(pools, session)
    with pytest.raises(AdapterUnavailable, match=r"could not be loaded .*\(HTTP 500\)") as info:
        await loader.ensure([pools.decode[0]], A)
    assert shown in str(info.value) and loader.loads["failed"] == 1


async def test_a_request_waits_no_longer_than_the_load_timeout(setup):
    engine, pools, session = setup
    engine.delay = 1.0
    loader = _loader(pools, session, load_timeout_s=0.2)
    with pytest.raises(AdapterUnavailable, match=r"still loading|in time") as info:
        await loader.ensure([pools.decode[0]], A)
    assert "adpA" in str(info.value)
    await loader.close()  # bounded, with the load still in flight


async def test_one_loaded_by_another_gateway_first_counts_as_loaded(setup):
    engine, pools, session = setup
    engine.loaded["adpA"] = "/adapters/adpA"  # another replica got there first: vLLM answers 400
    loader = _loader(pools, session)
    await loader.ensure([pools.decode[0]], A)
    assert "adpA" in pools.decode[0].served_models and loader.loads["ok"] == 1


async def test_past_the_bound_the_least_recently_used_adapter_is_unloaded(setup):
    engine, pools, session = setup
    loader = _loader(pools, session, max_adapters_per_engine=2, unload_idle_s=0)
    ep = pools.decode[0]
    await loader.ensure([ep], A)
    await loader.ensure([ep], B)
    await loader.ensure([ep], A)  # A used again: B is now the least recently used
    await loader.ensure([ep], C)
    assert set(engine.loaded) == {"adpA", "adpC"} and loader.unloads["ok"] == 1
    assert "adpB" not in ep.served_models and "adpB" not in ep.adapters


async def test_an_adapter_a_request_was_just_routed_with_is_not_unloaded(setup):
    """It may not have reached the engine yet: unloading it would make the engine answer 404."""
    engine, pools, session = setup
    loader = _loader(pools, session, max_adapters_per_engine=1, unload_idle_s=60)
    ep = pools.decode[0]
    await loader.ensure([ep], A)
    await loader.ensure([ep], B)
    assert set(engine.loaded) == {"adpA", "adpB"} and loader.unloads["ok"] == 0  # over the bound, for now


async def test_without_dynamic_loading_or_for_a_discovered_adapter_nothing_is_loaded(setup):
    engine, pools, session = setup
    off = AdapterLoader(pools, session, LoraConfig())
    assert await off.ensure([pools.decode[0]], A) == []
    discovered = Adapter("found", "tiny", "/x", configured=False)
    assert await _loader(pools, session).ensure([pools.decode[0]], discovered) == []
    assert engine.load_calls == 0
