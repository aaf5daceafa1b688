"""What the gateway believes about each engine, checked against the engine itself: which run of it
this is (a restart drops what was learned), what it serves (/v1/models), and how often it is
probed (a reloaded interval applies at once). Real HTTP on loopback; the engines are tiny servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.config import HealthConfig, SignalsConfig
from gateway.engines.enginestats import StatsScraper
from gateway.engines.modelcheck import ServedModels
from gateway.engines.pools import EngineStats, HealthChecker, Pools

PAGE = """\
vllm:num_requests_running{engine="0"} 0.0
vllm:num_requests_waiting{engine="0"} 0.0
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0"} 1.0
process_start_time_seconds %s
"""


class Engine:
    """An engine stand-in whose answers the test changes as it goes."""

    def __init__(self) -> None:
        self.started_at = 1000.0
        self.models = ["tiny"]
        self.healthy = True
        self.health_checks = 0
        self.body: bytes | None = None  # /v1/models answers this instead of a list of self.models

    async def serve(self) -> str:
        async def health(request: web.Request) -> web.Response:
            self.health_checks += 1
            return web.Response(status=200 if self.healthy else 503)

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=PAGE % self.started_at)

        async def models(request: web.Request) -> web.Response:
            return web.Response(
                body=self.body
                if self.body is not None
                else orjson.dumps({"object": "list", "data": [{"id": m} for m in self.models]}),
                content_type="application/json",
            )

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # the port is ours from here: no race with another process
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def engine():
    e = Engine()
    e.url = await e.serve()
    yield e
    await e.runner.cleanup()


async def test_a_new_engine_run_makes_the_gateway_forget_it(engine):
    restarted: list[str] = []
    pools = Pools([], [engine.url], on_restart=lambda ep: restarted.append(ep.url))
    async with aiohttp.ClientSession() as session:
        scraper = StatsScraper(pools, session, SignalsConfig())
        ep = pools.decode[0]
        assert await scraper.scrape(ep) and restarted == []
        assert await scraper.scrape(ep) and restarted == []  # same run
        engine.started_at = 2000.0
        assert await scraper.scrape(ep)
        assert restarted == [engine.url]


async def test_an_engine_back_from_down_is_checked_before_routing_sees_it(engine):
    restarted: list[str] = []
    pools = Pools([], [engine.url], on_restart=lambda ep: restarted.append(ep.url))
    async with aiohttp.ClientSession() as session:
        scraper = StatsScraper(pools, session, SignalsConfig())
        models = ServedModels(pools, session, ["tiny"])
        ups: list[bool] = []

        async def on_up(ep, recovering: bool) -> None:
            ups.append(recovering)
            if recovering:
                await scraper.recovered(ep)
            await models.check(ep)

        health = HealthChecker(pools, session, HealthConfig(failures_to_mark_down=1), on_up=on_up)
        ep = pools.decode[0]
        await health.probe(ep)
        assert ep.healthy and ups == [False] and ep.served_models == frozenset({"tiny"})
        await scraper.scrape(ep)
        engine.healthy = False
        await health.probe(ep)
        assert not ep.healthy
        engine.healthy, engine.started_at = True, 5000.0  # it came back as a new process
        await health.probe(ep)
        assert ep.healthy and ups == [False, True] and restarted == [engine.url]
        assert ep.served_models == frozenset({"tiny"})  # asked again after the restart


async def test_a_recovered_engine_whose_metrics_cannot_tell_is_taken_as_new(engine):
    restarted: list[str] = []
    pools = Pools([], [engine.url], on_restart=lambda ep: restarted.append(ep.url))
    ep = pools.decode[0]
    ep.stats = EngineStats(0, 0, None, 16, time.monotonic())  # no start time, no counter
    async with aiohttp.ClientSession() as session:
        await StatsScraper(pools, session, SignalsConfig()).recovered(ep)
    assert restarted == [engine.url]


async def test_served_models_are_compared_with_the_configured_names(engine, caplog):
    pools = Pools([engine.url], [engine.url])
    async with aiohttp.ClientSession() as session:
        models = ServedModels(pools, session, ["tiny", "big"])
        assert models.status()["unchecked"] == [engine.url, engine.url]
        await models.check_all()
    status = models.status()
    assert status["configured"] == ["tiny", "big"] and status["unchecked"] == []
    assert [(m["pool"], m["missing"], m["served"]) for m in status["mismatched"]] == [
        ("prefill", ["big"], ["tiny"]),
        ("decode", ["big"], ["tiny"]),
    ]
    assert sum("does not serve big" in r.message for r in caplog.records) == 2


# Valid JSON that is not a model list: the engine's served models cannot be read from it.
NOT_A_MODEL_LIST = [
    b'{"object":"list","data":null}',
    b'{"data":5}',
    b'{"data":"tiny"}',
    b'{"data":{"id":"tiny"}}',
    b'{"object":"list"}',
    b'[{"id":"tiny"}]',
    b"null",
]


@contextlib.asynccontextmanager
async def _checked_on_up(engine):
    """Pools with ``engine``, whose served models are asked as it comes up (as the gateway does)."""
    pools = Pools([], [engine.url])
    async with aiohttp.ClientSession() as session:
        models = ServedModels(pools, session, ["tiny"])

        async def on_up(ep, recovering: bool) -> None:
            await models.check(ep)

        health = HealthChecker(pools, session, HealthConfig(failures_to_mark_down=1), on_up=on_up)
        try:
            yield pools, models, health
        finally:
            await health.stop()


@pytest.mark.parametrize("body", NOT_A_MODEL_LIST)
async def test_an_engine_whose_model_list_is_wrongly_typed_still_comes_up(engine, body, caplog):
    """As an engine that does not answer /v1/models: up, its served models unknown (not "none")."""
    engine.body = body
    async with _checked_on_up(engine) as (pools, models, health):
        ep = pools.decode[0]
        with caplog.at_level(logging.DEBUG, logger="gateway.engines.modelcheck"):
            await health.start()  # gateway startup
            await models.check_all()  # a reload
        assert ep.healthy and pools.ready()
        assert ep.served_models is None and models.status()["unchecked"] == [engine.url]
        assert any("not a model list" in r.message for r in caplog.records)
        engine.body = None
        await models.check(ep)
        assert ep.served_models == frozenset({"tiny"})
        engine.body = body
        await models.check(ep)
        assert ep.served_models == frozenset({"tiny"})  # what it said before stays


@pytest.mark.parametrize(
    ("body", "served"),
    [
        (b'{"data":[5,"tiny",null,["tiny"]]}', frozenset()),
        (b'{"data":[{"id":["tiny"]},{"id":5},{"id":null},{"id":{"tiny":1}}]}', frozenset()),
        (b'{"data":[7,{"id":["x"]},{"id":"tiny","root":5,"parent":null}]}', frozenset({"tiny"})),
    ],
)
async def test_wrongly_typed_model_cards_name_nothing_and_the_engine_comes_up(engine, body, served):
    engine.body = body
    async with _checked_on_up(engine) as (pools, models, health):
        ep = pools.decode[0]
        await health.start()
        await models.check_all()
    assert ep.healthy and pools.ready()
    assert ep.served_models == served and ep.adapters == {}


async def test_a_reloaded_health_interval_applies_at_once(engine):
    pools = Pools([], [engine.url])
    async with aiohttp.ClientSession() as session:
        health = HealthChecker(pools, session, HealthConfig(interval_s=3600))
        await health.start()
        try:
            first = engine.health_checks
            await asyncio.sleep(0.2)
            assert engine.health_checks == first  # an hour to go
            health.configure(HealthConfig(interval_s=0.05))
            async with asyncio.timeout(5):
                while engine.health_checks < first + 3:  # noqa: ASYNC110 - polling a counter the server bumps
                    await asyncio.sleep(0.01)
        finally:
            await health.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket closes


async def test_a_refused_probe_marks_an_engine_down_at_once():
    """A busy engine may miss a probe (a run of failures takes it out); one whose port refuses the
    connection is gone, and the first such probe says so."""
    pools = Pools([], [f"http://127.0.0.1:{closed_port()}"])
    [ep] = pools.decode
    ep.mark_up()
    async with aiohttp.ClientSession() as session:
        health = HealthChecker(pools, session, HealthConfig(failures_to_mark_down=3))
        await health.probe(ep)
    assert not ep.healthy and not pools.ready()


async def test_ready_probes_the_decode_pool_afresh_and_shares_one_round(engine):
    """/ready right after the engine died says so, whatever the interval; twenty concurrent
    /ready callers cost the engine one probe."""
    pools = Pools([], [engine.url])
    async with aiohttp.ClientSession() as session:
        health = HealthChecker(pools, session, HealthConfig(interval_s=3600, failures_to_mark_down=1))
        await health.start()
        try:
            assert pools.ready()
            engine.healthy = False
            await asyncio.sleep(HealthChecker.READY_MAX_AGE_S)
            before = engine.health_checks
            await asyncio.gather(*(health.fresh() for _ in range(20)))
            assert engine.health_checks == before + 1 and not pools.ready()
            await health.fresh()  # within READY_MAX_AGE_S of that round: no probe
            assert engine.health_checks == before + 1
        finally:
            await health.stop()
