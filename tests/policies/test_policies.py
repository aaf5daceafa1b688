from __future__ import annotations

import pytest

from policies import registry
from policies.base import Decider, EndpointView, Path, Picker, PoolSnapshot, RequestContext
from policies.least_inflight import LeastInflight
from policies.pipeline import NoEndpointError, RoutingPipeline
from policies.token_threshold import TokenThreshold


def ep(url: str, pool: str = "decode", healthy: bool = True, in_flight: int = 0) -> EndpointView:
    return EndpointView(url, pool, healthy, in_flight)


def ctx(tokens: int, **kw) -> RequestContext:
    return RequestContext(model="m", request_id="r", token_ids=list(range(tokens)), **kw)


POOLS = PoolSnapshot(prefill=(ep("p0", "prefill"),), decode=(ep("d0"), ep("d1")))


def test_token_threshold_boundary():
    policy = TokenThreshold(threshold=100)
    assert policy.decide(ctx(99), POOLS).path is Path.DIRECT
    choice = policy.decide(ctx(100), POOLS)
    assert choice.path is Path.PD
    assert choice.reason == "long_prompt" and choice.detail == "tokens=100>=100"


def test_token_threshold_default_is_4096():
    assert TokenThreshold().threshold == 4096


@pytest.mark.parametrize("bad", [0, -1, "4096", True, 1.5])
def test_token_threshold_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        TokenThreshold(threshold=bad)


def test_least_inflight_prefers_idle_and_spreads_ties():
    picker = LeastInflight()
    assert picker.pick(ctx(1), [ep("a", in_flight=3), ep("b", in_flight=1)]).url == "b"
    picks = {picker.pick(ctx(1), [ep("a"), ep("b")]).url for _ in range(4)}
    assert picks == {"a", "b"}


def pipeline(threshold: int = 10) -> RoutingPipeline:
    return RoutingPipeline(TokenThreshold(threshold), LeastInflight())


def test_pipeline_pd_picks_both_pools():
    d = pipeline().route(ctx(50), POOLS)
    assert d.path is Path.PD and d.prefill.url == "p0" and d.decode.pool == "decode"


def test_pipeline_skips_unhealthy_endpoints():
    pools = PoolSnapshot(prefill=(), decode=(ep("d0", healthy=False), ep("d1")))
    for _ in range(3):
        assert pipeline().route(ctx(1), pools).decode.url == "d1"


def test_pipeline_falls_back_to_direct_without_prefill():
    pools = PoolSnapshot(prefill=(ep("p0", "prefill", healthy=False),), decode=(ep("d0"),))
    d = pipeline().route(ctx(50), pools)
    assert d.path is Path.DIRECT and d.reason == "no_prefill_endpoint" and d.prefill is None


def test_pipeline_keeps_local_only_requests_direct():
    d = pipeline().route(ctx(50, local_only="batch_prompts"), POOLS)
    assert d.path is Path.DIRECT and d.reason == "batch_prompts"


def test_pipeline_without_decode_endpoint():
    with pytest.raises(NoEndpointError):
        pipeline().route(ctx(1), PoolSnapshot(prefill=POOLS.prefill, decode=(ep("d0", healthy=False),)))


def test_registry_builds_by_name_and_checks_params():
    assert registry.build("token_threshold", {"threshold": 7}, Decider).threshold == 7
    assert isinstance(registry.build("least_inflight", {}, Picker), LeastInflight)
    with pytest.raises(registry.PolicyError, match="unknown policy 'nope'"):
        registry.build("nope", {}, Decider)
    with pytest.raises(registry.PolicyError, match="token_threshold"):
        registry.build("token_threshold", {"treshold": 7}, Decider)
    with pytest.raises(registry.PolicyError, match="is not a Picker"):
        registry.build("token_threshold", {}, Picker)


def test_registry_loads_third_party_entry_points(monkeypatch):
    class Always:
        def decide(self, ctx, pools):
            from policies.base import PathChoice

            return PathChoice(Path.PD, "always")

    class FakeEntryPoint:
        name = "always_pd"

        def load(self):
            return Always

    monkeypatch.setattr(
        registry, "entry_points", lambda group: [FakeEntryPoint()] if group == "pdgate.policies" else []
    )
    assert registry.build("always_pd", {}, Decider).decide(ctx(1), POOLS).path is Path.PD


def test_pd_picks_spread_over_both_pools():
    """With no load, successive P/D requests visit every prefill and every decode endpoint."""
    pools = PoolSnapshot(prefill=(ep("p0", "prefill"), ep("p1", "prefill")), decode=(ep("d0"), ep("d1")))
    pipe = pipeline()
    pairs = {(d.prefill.url, d.decode.url) for d in (pipe.route(ctx(50), pools) for _ in range(8))}
    assert {p for p, _ in pairs} == {"p0", "p1"} and {d for _, d in pairs} == {"d0", "d1"}


def test_least_inflight_takes_no_config():
    with pytest.raises(registry.PolicyError):
        registry.build("least_inflight", {"_turns": {}}, Picker)
