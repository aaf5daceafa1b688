"""Every background task the gateway starts stops within a bound, so SIGTERM never hangs.

The Redis sync loop used to ignore a cancel now and then (Python 3.11's ``asyncio.wait_for``, which
redis-py sends every command under, swallows a cancel that lands as the send completes), and
shutdown waited on it forever. These tests stop things at random moments and against peers that
never answer, and only assert that each stop returns within the bound (plus a generous margin for
a loaded machine), never how fast the normal case is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aiohttp
import pytest

from gateway.background import STOP_BOUND_S, cancel_checkpoint, stop_task, stop_tasks
from gateway.cluster.redis_state import RedisState
from gateway.config import HealthConfig, SignalsConfig, StateConfig
from gateway.engines.enginestats import StatsScraper
from gateway.engines.legs import KVReleaser
from gateway.engines.pools import HealthChecker, Pools

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
MARGIN_S = 10.0  # on top of a bound: a shared, noisy machine must not fail a test that works


async def returns_within(aw: Awaitable[Any], seconds: float, what: str) -> Any:
    """Fail unless ``aw`` completes within ``seconds``; never hangs itself (asyncio.wait does not
    wait for a cancelled task to unwind, and a task that would not stop is left behind)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if task not in done:
        task.cancel()
        pytest.fail(f"{what} did not return within {seconds:.0f} s")
    return task.result()


def _redis_answers() -> bool:
    try:
        with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=0.5) as s:
            s.settimeout(0.5)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# -- the helper ------------------------------------------------------------------------------------


async def test_a_task_that_swallows_its_first_cancel_is_cancelled_again():
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # what a buggy library does
            swallowed.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(swallows_once(), name="swallows-once")
    await asyncio.sleep(0)
    assert await returns_within(stop_task(task, bound_s=2.0), 2.0 + MARGIN_S, "stop_task")
    assert swallowed.is_set() and task.cancelled()


async def test_a_task_that_never_ends_is_given_up_on_with_a_warning(caplog: pytest.LogCaptureFixture):
    let_go = asyncio.Event()

    async def never_ends() -> None:
        while not let_go.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(never_ends(), name="immortal")
    await asyncio.sleep(0)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.background"):
            ended = await returns_within(stop_task(task, bound_s=0.5), 0.5 + MARGIN_S, "stop_task")
        assert ended is False and not task.done()
        assert any(r.levelno == logging.WARNING and "immortal" in r.getMessage() for r in caplog.records)
    finally:
        let_go.set()
        task.cancel()
        await asyncio.wait({task}, timeout=MARGIN_S)


async def test_stopping_nothing_a_finished_task_or_a_failed_one(caplog: pytest.LogCaptureFixture):
    async def fails() -> None:
        raise RuntimeError("boom")

    async def returns() -> int:
        return 1

    failed = asyncio.create_task(fails(), name="fails")
    finished = asyncio.create_task(returns(), name="returns")
    await asyncio.sleep(0.01)
    assert await stop_task(None)
    with caplog.at_level(logging.WARNING, logger="gateway.background"):
        assert await stop_tasks([failed, finished, None])
    assert [r for r in caplog.records if "fails" in r.getMessage()]  # retrieved and logged, not lost


async def test_grace_lets_a_task_finish_its_work_before_cancelling():
    async def last_round_trip() -> str:
        await asyncio.sleep(0.05)
        return "written"

    task = asyncio.create_task(last_round_trip())
    assert await stop_task(task, grace_s=STOP_BOUND_S)
    assert not task.cancelled() and task.result() == "written"


async def test_a_loop_ends_at_its_checkpoint_when_a_library_swallowed_the_cancel():
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            with contextlib.suppress(asyncio.CancelledError):  # a library swallowing every cancel
                await asyncio.sleep(3600)
            cancel_checkpoint()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    assert await returns_within(stop_task(task, bound_s=2.0), 2.0 + MARGIN_S, "stop_task")
    assert task.cancelled() and rounds == 1  # ended by the checkpoint, not by a re-cancel


async def test_a_cancel_that_is_not_a_stop_does_not_end_a_loop_at_its_checkpoint():
    """E.g. a library's own timeout that forgets to uncancel(): only a stop ends the loop."""
    rounds = 0
    round_done = asyncio.Event()

    async def loop() -> None:
        nonlocal rounds
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
            cancel_checkpoint()
            rounds += 1
            round_done.set()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    task.cancel()  # swallowed, and task.cancelling() stays 1
    await returns_within(round_done.wait(), MARGIN_S, "the next round")
    assert rounds == 1 and not task.done()
    assert await stop_task(task, bound_s=2.0)


# -- RedisState: stops at random moments -----------------------------------------------------------


async def test_redis_state_stops_within_the_bound_at_any_moment():
    """Hundreds of start/stop cycles at random moments (the original hang: ~5% of stops with a
    0.05 s sync interval); five replicas at a time, so the test stays well under 20 s."""
    if not await asyncio.to_thread(_redis_answers):
        pytest.skip(f"no Redis answers on {REDIS_HOST}:{REDIS_PORT} (start redis-server; .ci/run does)")
    prefix = f"pdgate-test-shutdown-{uuid.uuid4().hex[:8]}"
    rng = random.Random()
    lanes, per_lane = 5, 100
    stops = 0

    async def lane() -> None:
        nonlocal stops
        for _ in range(per_lane):
            cfg = StateConfig(
                backend="redis",
                url=f"redis://{REDIS_HOST}:{REDIS_PORT}/0",
                key_prefix=prefix,
                sync_interval_s=rng.uniform(0.01, 0.05),
            )
            state = RedisState(cfg, 60.0, Pools(["http://p-0:8000"], ["http://d-0:8000", "http://d-1:8000"]))
            await state.start()
            tasks = list(state._tasks)
            for _ in range(rng.randrange(3)):  # the writer has round trips in flight too
                state.learn("http://d-0:8000", [rng.getrandbits(64) for _ in range(4)])
            await asyncio.sleep(rng.uniform(0, 0.06))
            await returns_within(state.stop(), STOP_BOUND_S + MARGIN_S, "RedisState.stop")
            assert all(t.done() for t in tasks), [t for t in tasks if not t.done()]
            stops += 1

    try:
        await asyncio.gather(*(lane() for _ in range(lanes)))
    finally:
        import redis.asyncio as aioredis

        client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=2)
        try:
            keys = [k async for k in client.scan_iter(f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    assert stops == lanes * per_lane


async def test_redis_state_stop_is_bounded_when_redis_is_gone():
    """Redis answering nothing at all (accepts, never replies): stop's last round trip and close
    cannot hold shutdown up."""
    async with StuckServer() as (port, _):
        cfg = StateConfig(
            backend="redis",
            url=f"redis://127.0.0.1:{port}/0",
            key_prefix="pdgate-test-gone",
            sync_interval_s=0.01,
            timeout_s=0.05,
        )
        state = RedisState(cfg, 60.0, Pools([], ["http://d-0:8000"]))
        await state.start()  # fails (times out), routes on local state
        await asyncio.sleep(0.1)
        await returns_within(state.stop(), STOP_BOUND_S + MARGIN_S, "RedisState.stop")


# -- probes stuck on a server that accepts and never answers -----------------------------------------


class StuckServer:
    """A TCP server that accepts, reads, and never answers."""

    def __init__(self) -> None:
        self.accepted = 0
        self._accept = asyncio.Event()
        self._conns: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._accept.set()
        self._conns.append(writer)
        while await reader.read(65536):
            pass

    async def connections(self, n: int) -> None:
        """Return once ``n`` connections came in (bounded, so a broken test fails, not hangs)."""

        async def wait() -> None:
            while self.accepted < n:
                self._accept.clear()
                await self._accept.wait()

        await returns_within(wait(), MARGIN_S, f"{n} connection(s) to the stuck server")

    async def __aenter__(self) -> tuple[int, StuckServer]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1], self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for w in self._conns:
            w.close()
        self._server.close()
        await asyncio.wait_for(self._server.wait_closed(), MARGIN_S)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_health_checker_stops_while_its_probe_is_stuck(session: aiohttp.ClientSession):
    async with StuckServer() as (port, server):
        pools = Pools([], [f"http://127.0.0.1:{port}"])
        checker = HealthChecker(pools, session, HealthConfig(interval_s=0.01, timeout_s=0.2))
        await checker.start()  # its first probe times out
        checker.configure(HealthConfig(interval_s=0.01, timeout_s=3600.0))  # the next one hangs
        await server.connections(2)
        await returns_within(checker.stop(), STOP_BOUND_S + MARGIN_S, "HealthChecker.stop")


async def test_stats_scraper_stops_while_its_scrape_is_stuck(session: aiohttp.ClientSession):
    async with StuckServer() as (port, server):
        pools = Pools([], [f"http://127.0.0.1:{port}"])
        scraper = StatsScraper(pools, session, SignalsConfig(scrape_interval_s=0.01, scrape_timeout_s=3600.0))
        scraper.start()
        await server.connections(1)
        await returns_within(scraper.stop(), STOP_BOUND_S + MARGIN_S, "StatsScraper.stop")


async def test_kv_releaser_close_cancels_releases_still_out():
    class Hangs:
        async def post(self, *args: Any, **kwargs: Any) -> Any:
            await asyncio.Event().wait()

    releaser = KVReleaser(Hangs())  # type: ignore[arg-type]
    pools = Pools(["http://p-0:8000"], ["http://d-0:8000"])
    releaser.release(pools.decode[0], "m", {"remote_engine_id": "e"}, "req-1")
    tasks = list(releaser._tasks)
    await asyncio.sleep(0.01)
    await returns_within(releaser.close(), STOP_BOUND_S + MARGIN_S, "KVReleaser.close")
    assert all(t.done() for t in tasks)
