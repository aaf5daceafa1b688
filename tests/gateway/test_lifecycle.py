"""The gateway's parts start in order, stop within one bound (services together, then resources
in reverse), a failed start leaves nothing running, and a new config reaches each part in order."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.lifecycle import Lifecycle


def config() -> GatewayConfig:
    return parse_config(
        {
            "models": [{"name": "m", "tokenizer": "t", "max_model_len": 8}],
            "pools": {"decode": {"endpoints": ["http://127.0.0.1:1"]}},
        }
    )


async def test_parts_start_in_order_and_stop_services_then_resources_in_reverse() -> None:
    seen: list[str] = []
    life = Lifecycle()

    def step(what: str):
        async def run() -> None:
            seen.append(what)

        return run

    life.add("session", start=step("start session"), stop=step("close session"), resource=True)
    life.add("engines", stop=lambda: seen.append("close engines"), resource=True)
    life.add("discovery", start=step("start discovery"), stop=step("stop discovery"))
    life.add("health", start=lambda: seen.append("start health"), stop=step("stop health"))
    async with life:
        assert seen == ["start session", "start discovery", "start health"]
    assert seen[3:5] == ["stop discovery", "stop health"]  # services first (together)
    assert seen[5:] == ["close engines", "close session"]  # then resources, last added first


async def test_services_stop_together() -> None:
    """Each stop is bounded on its own: together, shutdown takes one bound, not the sum."""
    events: list[str] = []
    life = Lifecycle()

    def slow(i: int):
        async def stop() -> None:
            events.append(f"begin {i}")
            await asyncio.sleep(0.05)
            events.append(f"end {i}")

        return stop

    for i in range(4):
        life.add(f"slow{i}", stop=slow(i))
    await life.start()
    await life.stop()
    assert events[:4] == [f"begin {i}" for i in range(4)]  # all four under way before any ended


async def test_a_stop_that_hangs_is_left_behind_after_the_bound() -> None:
    life = Lifecycle(bound_s=0.1)
    stopped: list[str] = []
    life.add("stuck", stop=lambda: asyncio.Event().wait())
    life.add("fine", stop=lambda: stopped.append("fine"))
    await life.start()
    await asyncio.wait_for(life.stop(), timeout=5)
    assert stopped == ["fine"]


async def test_a_failed_start_stops_what_had_started() -> None:
    stopped: list[str] = []
    life = Lifecycle()
    life.add("first", stop=lambda: stopped.append("first"))
    life.add("session", stop=lambda: stopped.append("session"), resource=True)

    def broken() -> None:
        raise RuntimeError("no port")

    life.add("broken", start=broken, stop=lambda: stopped.append("broken"))
    life.add("never", stop=lambda: stopped.append("never"))
    with pytest.raises(RuntimeError, match="no port"):
        await life.start()
    assert sorted(stopped) == ["first", "session"]


async def test_a_stop_that_raises_does_not_keep_the_others_running() -> None:
    stopped: list[str] = []
    life = Lifecycle()

    def boom() -> None:
        raise OSError("socket gone")

    life.add("boom", stop=boom)
    life.add("other", stop=lambda: stopped.append("other"))
    life.add("res", stop=lambda: stopped.append("res"), resource=True)
    await life.start()
    await life.stop()
    assert stopped == ["other", "res"]


async def test_a_new_config_reaches_each_part_in_order_and_names_are_unique() -> None:
    got: list[tuple[str, str]] = []
    life = Lifecycle()
    life.add("a", configure=lambda cfg: got.append(("a", cfg.models[0].name)))

    async def b(cfg: GatewayConfig) -> None:
        got.append(("b", cfg.models[0].name))

    life.add("b", configure=b)
    await life.configure(config())
    assert got == [("a", "m"), ("b", "m")]
    with pytest.raises(ValueError, match="already registered"):
        life.add("a")


async def test_drains_run_together_until_done_or_cut_at_the_bound() -> None:
    """``drain`` lets work in flight finish before the stop; one that never finishes is cut at the
    bound and the stop still comes."""
    seen: list[str] = []
    life = Lifecycle()
    finished = asyncio.Event()

    async def quick() -> None:
        await asyncio.sleep(0.05)
        seen.append("quick drained")
        finished.set()

    life.add("quick", drain=quick, stop=lambda: seen.append("quick stopped"))
    life.add("stuck", drain=lambda: asyncio.Event().wait(), stop=lambda: seen.append("stuck stopped"))
    life.add("plain", stop=lambda: seen.append("plain stopped"))
    await life.start()
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(life.drain(0.3), timeout=5)
    assert 0.25 <= loop.time() - began < 3  # the stuck one held it to the bound, not past
    assert seen == ["quick drained"]  # nothing stopped while draining
    await life.stop()
    assert sorted(seen[1:]) == ["plain stopped", "quick stopped", "stuck stopped"]


async def test_a_drain_before_start_or_without_drains_returns_at_once() -> None:
    life = Lifecycle()
    life.add("plain", stop=lambda: None)
    await asyncio.wait_for(life.drain(30), timeout=1)  # not started: nothing to drain
    await life.start()
    await asyncio.wait_for(life.drain(30), timeout=1)
    await life.stop()
