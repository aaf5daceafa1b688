"""The live planner (gateway/ops/live_planner.py): what it records, what it recommends, what it exports."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ConfigError, parse_config
from gateway.engines.pools import Pools
from gateway.ops.live_planner import Demand, DemandPlanner, pd_threshold, recommend
from gateway.ops.metrics import GatewayMetrics
from policies.base import Finished, RequestContext

BASE = {
    "models": [{"name": "m", "tokenizer": "/tok", "max_model_len": 32768}],
    "pools": {"prefill": {"endpoints": ["http://p0:8000"]}, "decode": {"endpoints": ["http://d0:8000"]}},
    "routing": {"decider": {"name": "token_threshold", "threshold": 2048}},
    "planner": {"enabled": True, "tail": True},
}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _finish(demand: Demand, prompt: int, output: int, status: int = 200) -> None:
    ctx = RequestContext(model="m", request_id="r", token_ids=[1] * prompt)
    demand.on_finished(ctx, None, Finished(status, "pd", (), 1.0, 0.1, output))  # type: ignore[arg-type]


def _traffic(demand: Demand, clock: Clock, rate: float, seconds: float) -> None:
    """A 30/70 mix of 10k-token and 800-token prompts at ``rate`` requests/s."""
    n = int(rate * seconds)
    for i in range(n):
        clock.t += 1 / rate
        _finish(demand, 10000 if i % 10 < 3 else 800, 400)


def test_demand_keeps_its_window_and_knows_how_long_it_watched():
    clock = Clock()
    demand = Demand(clock=clock)
    _finish(demand, 100, 10, status=429)  # refused: not traffic the engines served
    _traffic(demand, clock, 2.0, 60)
    seen, span = demand.window(300)
    assert len(seen) == 120 and span == pytest.approx(60)  # up for 60 s: the rate is 2/s, not 120/300
    clock.t += 290  # 350 s after the first request, 290 s after the last
    seen, span = demand.window(300)
    assert len(seen) == 21 and span == 300  # only the requests of the last 300 s are left (t >= 1050)


def test_recommendation_grows_with_traffic_and_splits_pools():
    cfg = parse_config(BASE).planner
    slow_clock, fast_clock = Clock(), Clock()
    slow, fast = Demand(clock=slow_clock), Demand(clock=fast_clock)
    _traffic(slow, slow_clock, 1.0, 300)
    _traffic(fast, fast_clock, 4.0, 300)
    a = recommend(cfg, *slow.window(300), threshold=2048)
    b = recommend(cfg, *fast.window(300), threshold=2048)
    assert a.met and b.met and 0 < a.prefill < b.prefill and 0 < a.decode < b.decode
    assert b.prefill == pytest.approx(4 * a.prefill, rel=0.35)  # roughly proportional: replicas can sum it
    colocated = recommend(cfg, *fast.window(300), threshold=None)
    assert colocated.prefill == 0 and colocated.decode > b.decode  # long prompts stall colocated streams
    assert recommend(cfg, [], 300, 2048).decode == 0


def test_threshold_follows_routing_unless_set():
    cfg = parse_config(BASE)
    assert pd_threshold(cfg, True) == 2048 and pd_threshold(cfg, False) is None
    cfg = parse_config({**BASE, "planner": {"enabled": True, "pd_threshold": 9000}})
    assert pd_threshold(cfg, True) == 9000


@pytest.mark.parametrize(
    ("planner", "message"),
    [
        ({"enabled": True, "profile": "no-such-profile"}, "unknown profile"),
        ({"slos": [{"max_prompt_tokens": 100, "ttft_s": 1, "itl_p90_s": 0.05}]}, "the last SLO"),
        (
            {
                "slos": [
                    {"max_prompt_tokens": 100, "ttft_s": 1, "itl_p90_s": 0.05},
                    {"max_prompt_tokens": 50, "ttft_s": 1, "itl_p90_s": 0.05},
                    {"ttft_s": 1, "itl_p90_s": 0.05},
                ]
            },
            "must increase",
        ),
        ({"window_s": 1}, "planner.window_s"),
    ],
)
def test_bad_planner_configs_are_refused(planner, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "planner": planner})


async def test_the_planner_exports_its_recommendation_and_stops_in_bound():
    cfg = parse_config({**BASE, "planner": {**BASE["planner"], "interval_s": 1}})
    clock = Clock()
    demand = Demand(clock=clock)
    _traffic(demand, clock, 2.0, 120)
    current = {"cfg": cfg}
    planner = DemandPlanner(demand, lambda: current["cfg"], lambda: True)
    metrics = GatewayMetrics(Pools([], ["http://d0:8000"]))
    metrics.watch_planner(planner.exported)
    assert b"pdgate_pool_desired_engines" not in metrics.render()  # nothing computed yet: no series
    await planner.run_once()
    text = metrics.render().decode()
    assert 'pdgate_pool_desired_engines{pool="prefill"}' in text and "pdgate_planner_unmet 0.0" in text
    assert planner.latest is not None and planner.latest.requests == 240
    current["cfg"] = parse_config({**BASE, "planner": {"enabled": False}})
    assert await planner.run_once() is None and b"pdgate_pool_desired_engines" not in metrics.render()
    planner.start()
    t0 = asyncio.get_running_loop().time()
    await planner.stop()
    assert asyncio.get_running_loop().time() - t0 < 1


def test_requests_no_engine_count_can_serve_are_counted_apart_not_zeroed():
    """A share of 70k-token prompts (prefill alone ~4 s) under a 3 s TTFT SLO: more engines would not
    help them. They are counted, the rest are planned for, and the figures never drop to 0."""
    cfg = parse_config(BASE).planner
    clock = Clock()
    demand = Demand(clock=clock)
    for i in range(600):
        clock.t += 0.5
        _finish(demand, 70000 if i % 8 == 0 else 3000, 300)
    rec = recommend(cfg, *demand.window(300), threshold=2048)
    assert not rec.met and rec.unservable == 75
    assert rec.decode is not None and rec.decode > 0 and rec.prefill is not None and rec.prefill > 0


def test_a_round_can_be_stopped():
    from engine_model import planner

    cfg = parse_config(BASE).planner
    clock = Clock()
    demand = Demand(clock=clock)
    _traffic(demand, clock, 4.0, 300)
    with pytest.raises(planner.Stopped):
        recommend(cfg, *demand.window(300), threshold=2048, stop=lambda: True)


async def test_a_planner_that_is_off_keeps_nothing():
    clock = Clock()
    demand = Demand(clock=clock)
    off = parse_config({**BASE, "planner": {"enabled": False}})
    planner = DemandPlanner(demand, lambda: off, lambda: True)
    _traffic(demand, clock, 2.0, 60)
    assert demand.window(300)[0] == [] and await planner.run_once() is None
    await planner.stop()
