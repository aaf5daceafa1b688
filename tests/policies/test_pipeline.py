"""The routing pipeline: filters, weighted scorers and picker per pool, then the decider."""

from __future__ import annotations

import pytest

from policies.base import Path, PathChoice, PoolSnapshot
from policies.load import Load
from policies.max_score import MaxScore
from policies.pipeline import NoEndpointError, PoolPipeline, RoutingPipeline, Weighted
from policies.prefix_affinity import PrefixAffinity
from policies.token_threshold import TokenThreshold

from .helpers import ctx, ep

POOLS = PoolSnapshot(prefill=(ep("p0", "prefill"),), decode=(ep("d0"), ep("d1")))


def pipeline(threshold: int = 10, scorers: tuple[Weighted, ...] = ()) -> RoutingPipeline:
    return RoutingPipeline(
        TokenThreshold(threshold=threshold),
        decode=PoolPipeline(MaxScore(), scorers=scorers),
        prefill=PoolPipeline(MaxScore(), scorers=scorers),
    )


def test_pipeline_pd_picks_both_pools():
    d = pipeline().route(ctx(50), POOLS).decision
    assert d.path is Path.PD and d.prefill.url == "p0" and d.decode.pool == "decode"


def test_pipeline_skips_unhealthy_endpoints():
    pools = PoolSnapshot(prefill=(), decode=(ep("d0", healthy=False), ep("d1")))
    for _ in range(3):
        assert pipeline().route(ctx(1), pools).decision.decode.url == "d1"


def test_pipeline_falls_back_to_direct_without_prefill():
    pools = PoolSnapshot(prefill=(ep("p0", "prefill", healthy=False),), decode=(ep("d0"),))
    d = pipeline().route(ctx(50), pools).decision
    assert d.path is Path.DIRECT and d.reason == "no_prefill_endpoint" and d.prefill is None


def test_pipeline_keeps_local_only_requests_direct():
    d = pipeline().route(ctx(50, local_only="batch_prompts"), POOLS).decision
    assert d.path is Path.DIRECT and d.reason == "batch_prompts"


def test_pipeline_without_decode_endpoint():
    with pytest.raises(NoEndpointError):
        pipeline().route(ctx(1), PoolSnapshot(prefill=POOLS.prefill, decode=(ep("d0", healthy=False),)))


def test_pipeline_weighs_scorers_and_explains():
    """Prefix affinity (weight 2) beats load (weight 1): the endpoint holding the prompt wins even
    though it is busier; the trace shows every scorer's view."""
    scorers = (Weighted("prefix_affinity", PrefixAffinity(), 2.0), Weighted("load", Load(), 1.0))
    pools = PoolSnapshot(prefill=(), decode=(ep("d0", in_flight=3), ep("d1")))
    c = ctx(64, cached_tokens={"d0": 48})
    route = pipeline(1000, scorers).route(c, pools, explain=True)
    assert route.decision.decode.url == "d0"
    steps = route.trace["decode"]
    assert steps[0] == {"scorer": "prefix_affinity", "weight": 2.0, "scores": {"d0": 0.75, "d1": 0.0}}
    assert steps[1]["scores"] == {"d0": 0.25, "d1": 1.0}  # 3 in flight against the floor of 4
    assert steps[2]["picked"] == "d0"
    # without the cached prefix, load decides
    assert pipeline(1000, scorers).route(ctx(64), pools).decision.decode.url == "d1"


def test_pipeline_skips_a_filter_that_would_leave_nothing():
    class NoneLeft:
        def filter(self, ctx, candidates):
            return []

    class OnlyD1:
        def filter(self, ctx, candidates):
            return [e for e in candidates if e.url == "d1"]

    pipe = RoutingPipeline(
        TokenThreshold(threshold=10),
        decode=PoolPipeline(MaxScore(), filters=(("none", NoneLeft()), ("d1", OnlyD1()))),
        prefill=PoolPipeline(MaxScore()),
    )
    assert {pipe.route(ctx(1), POOLS).decision.decode.url for _ in range(4)} == {"d1"}


def test_decider_only_asks_for_a_prefill_endpoint_when_it_needs_one():
    asked = []

    class Probe:
        def decide(self, ctx, decode, prefill):
            asked.append(True)
            return PathChoice(Path.DIRECT, "short_prompt")

    class CountingPicker(MaxScore):
        calls: list[str] = []

        def pick(self, ctx, candidates, scores):
            self.calls.append(candidates[0].pool)
            return super().pick(ctx, candidates, scores)

    picker = CountingPicker()
    pipe = RoutingPipeline(Probe(), decode=PoolPipeline(picker), prefill=PoolPipeline(picker))
    pipe.route(ctx(5), POOLS)
    assert asked and picker.calls == ["decode"]


def test_pd_picks_spread_over_both_pools():
    """With no load, successive P/D requests visit every prefill and every decode endpoint."""
    pools = PoolSnapshot(prefill=(ep("p0", "prefill"), ep("p1", "prefill")), decode=(ep("d0"), ep("d1")))
    pipe = pipeline()
    pairs = {(d.prefill.url, d.decode.url) for d in (pipe.route(ctx(50), pools).decision for _ in range(8))}
    assert {p for p, _ in pairs} == {"p0", "p1"} and {d for _, d in pairs} == {"d0", "d1"}
