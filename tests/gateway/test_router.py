from __future__ import annotations

import time

import pytest

from gateway.config import RoutingConfig
from gateway.engines.pools import EngineStats, Pools
from gateway.request.router import NotServed, Prepared, Router
from policies.base import Finished, LegOutcome, LegReport, Path
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import PrefixBeliefs
from policies.beliefs.tiers import TIERS, TierHold, TierIndex
from policies.pipeline import Route


def served(index: PrefixIndex, prep: Prepared, route: Route) -> None:
    """What the lifecycle hooks do for a request whose legs all succeeded."""
    beliefs, d = PrefixBeliefs(index), route.decision
    beliefs.on_routed(prep.ctx, d)
    legs = [LegReport("decode", d.decode.url, LegOutcome.OK, d.path, 0.1)]
    if d.prefill is not None:
        legs.append(LegReport("prefill", d.prefill.url, LegOutcome.OK, d.path, 0.1))
    for leg in legs:
        beliefs.on_leg_done(prep.ctx, leg)
    beliefs.on_finished(prep.ctx, d, Finished(200, d.path.value, tuple(legs), 0.2))


def make(block_size: int | None = None, threshold: int = 64) -> tuple[Router, Pools, PrefixIndex]:
    pools = Pools(["http://p0"], ["http://d0", "http://d1"])
    for ep in pools.all():
        ep.healthy = True
    index = PrefixIndex()
    cfg = RoutingConfig.model_validate(
        {
            "decider": {"name": "token_threshold", "threshold": threshold},
            "prefix": {"block_size": block_size},
        }
    )
    return Router(cfg, pools, index), pools, index


def test_block_size_comes_from_the_engines_until_configured():
    router, pools, _ = make()
    assert router.hash_spec().block_size == 16  # vLLM's default until an engine says otherwise
    pools.decode[0].stats = EngineStats(0, 0, 0.0, 128, time.monotonic())
    assert router.hash_spec().block_size == 128
    assert router.hash_spec() is router.hash_spec()  # one spec (and its hash memo) per block size
    configured, pools, _ = make(block_size=32)
    pools.decode[0].stats = EngineStats(0, 0, 0.0, 128, time.monotonic())
    assert configured.hash_spec().block_size == 32


async def test_learned_prompt_routes_back_to_its_engine_and_goes_direct():
    router, _, index = make()
    tokens = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    first = await router.prepare("m", "r1", tokens, None, {})
    assert len(first.hashes) == 6 and first.ctx.cached_tokens == {}
    route = router.route(first)
    assert route.decision.path is Path.PD
    served(index, first, route)
    home = route.decision.decode.url
    again = await router.prepare("m", "r2", tokens, None, {})
    assert again.ctx.cached_tokens[home] == 96 and again.ctx.cached_tokens["http://p0"] == 96
    d = router.route(again).decision
    assert (d.path, d.decode.url, d.reason) == (Path.DIRECT, home, "prefix_cached")


async def test_cache_salt_separates_tenants():
    router, _, index = make()
    tokens = list(range(100))
    a = await router.prepare("m", "r", tokens, None, {}, cache_salt="tenant-a")
    served(index, a, router.route(a))
    assert (await router.prepare("m", "r", tokens, None, {}, cache_salt="tenant-b")).ctx.cached_tokens == {}
    assert (await router.prepare("m", "r", tokens, None, {}, cache_salt="tenant-a")).ctx.cached_tokens


async def test_explain_does_not_learn():
    router, _, index = make()
    prep = await router.prepare("m", "r", list(range(100)), None, {})
    router.route(prep, explain=True)
    assert index.stats().approximate == 0


async def test_prefix_disabled():
    pools = Pools([], ["http://d0"])
    pools.decode[0].healthy = True
    router = Router(RoutingConfig.model_validate({"prefix": {"enabled": False}}), pools, PrefixIndex())
    prep = await router.prepare("m", "r", list(range(100)), None, {})
    assert prep.hashes == () and prep.block_size == 0


async def test_waiting_for_the_prefill_pool_only_when_the_decider_wants_it():
    """With the prefill pool at its limit, a request waits for it (``wait_for_prefill``) only when
    the decider would send it P/D with room there: the cost model, which prices both paths, must
    not make a short prompt wait for prefill because it could not price P/D."""
    from gateway.request.router import Saturated

    pools = Pools(["http://p0"], ["http://d0"])
    for ep in pools.all():
        ep.healthy = True
    cfg = RoutingConfig.model_validate({"decider": {"name": "cost_model", "itl_budget_s": 0}})
    router = Router(cfg, pools, PrefixIndex())
    short = await router.prepare("m", "s", list(range(20)), None, {})
    long = await router.prepare("m", "l", list(range(20_000)), None, {})
    pools.prefill[0].backlog_tokens = 0
    pools.decode[0].backlog_tokens = 200_000  # a busy decode engine: P/D is faster for the long prompt
    assert router.route(long).decision.path is Path.PD
    pools.prefill[0].in_flight = 1  # the prefill pool at its limit of 1
    assert router.route(long, max_prefill=1).decision.reason == "no_prefill_endpoint"  # today: direct
    try:
        router.route(long, max_prefill=1, wait_for_prefill=True)
        raise AssertionError("the long prompt should wait for the prefill pool")
    except Saturated as sat:
        assert sat.phase == "prefill"
    pools.decode[0].backlog_tokens = 0
    d = router.route(short, max_prefill=1, wait_for_prefill=True).decision
    assert (d.path, d.reason) == (Path.DIRECT, "direct_faster")


async def test_per_request_data_is_published_when_the_request_is_prepared(monkeypatch):
    """The gateway's measurements (``MEASURED``), its other publishers, then the pipeline's own
    (which may read what the gateway put there): a new signal needs no field and no router change."""
    from policies import registry
    from policies.base import MEASURED, NOTHING_MEASURED, RequestContext
    from policies.beliefs.estimates import EngineEstimates
    from policies.data import Key

    tenant = Key[str]("test.tenant")
    doubled = Key[str]("test.tenant_twice")

    class Tenant:
        def publish(self, ctx: RequestContext) -> None:
            ctx.data.put(tenant, ctx.headers.get("x-tenant", "none"))

    class Twice:  # a third-party scorer that publishes too
        def publish(self, ctx: RequestContext) -> None:
            ctx.data.put(doubled, ctx.data.get(tenant, "") * 2)

        def score(self, ctx, candidates):
            return [0.0] * len(candidates)

    class EntryPoint:
        name = "twice"

        def load(self):
            return Twice

    monkeypatch.setattr(registry, "entry_points", lambda group: [EntryPoint()])
    pools = Pools([], ["http://d0"])
    pools.decode[0].healthy = True
    cfg = RoutingConfig.model_validate({"decode": {"scorers": [{"name": "load"}, {"name": "twice"}]}})
    est = EngineEstimates()
    router = Router(cfg, pools, PrefixIndex(), measured=est, publishers=[Tenant()])
    prep = await router.prepare("m", "r", list(range(100)), None, {"x-tenant": "ab"})
    assert prep.ctx.data.get(MEASURED) is est
    assert (prep.ctx.data.get(tenant), prep.ctx.data.get(doubled)) == ("ab", "abab")
    assert router.route(prep).decision.decode.url == "http://d0"
    plain = await Router(cfg, pools, PrefixIndex()).prepare("m", "r", list(range(100)), None, {})
    assert plain.ctx.data.get(MEASURED) is NOTHING_MEASURED and plain.ctx.data.get(doubled) == ""


async def test_policy_instances_are_named_in_traces_and_hooks():
    pools = Pools(["http://p0"], ["http://d0", "http://d1"])
    for ep in pools.all():
        ep.healthy = True
    cfg = RoutingConfig.model_validate(
        {
            "decider": {"name": "token_threshold", "instance": "long_prompts", "threshold": 10},
            "decode": {
                "scorers": [
                    {"name": "session_affinity", "instance": "by_user", "header": "x-user"},
                    {"name": "session_affinity", "instance": "by_chat", "header": "x-chat", "weight": 2},
                    {"name": "load"},
                ],
            },
        }
    )
    router = Router(cfg, pools, PrefixIndex())
    decode = router.pipeline.decode
    assert [(w.name, w.scorer.name, w.scorer.params.header) for w in decode.scorers[:2]] == [
        ("by_user", "by_user", "x-user"),
        ("by_chat", "by_chat", "x-chat"),
    ]
    assert [name for name, _ in router.pipeline.members()][:4] == [
        "decider.long_prompts",
        "decode.scorers.by_user",
        "decode.scorers.by_chat",
        "decode.scorers.load",
    ]
    prep = await router.prepare("m", "r", list(range(100)), None, {"x-chat": "c1", "x-user": "u1"})
    route = router.route(prep, explain=True)
    assert [step.get("scorer") for step in route.trace["decode"][:3]] == [
        "by_user",
        "by_chat",
        "load",
    ]
    assert route.decision.reason == "long_uncached"


async def test_with_tiers_on_each_engine_gets_its_prompt_by_tier_and_a_prefix_in_l1_stays_direct():
    """The GPU evicted the prompt on d0, which still holds it in its CPU tier: d0 loads it, so the
    long prompt goes direct there, said as such; d1 reaches only the shared store's part."""
    pools = Pools(["http://p0"], ["http://d0", "http://d1"])
    for ep in pools.all():
        ep.healthy = True
    cfg = RoutingConfig.model_validate(
        {
            "decider": {"name": "token_threshold", "threshold": 64},
            "prefix": {"block_size": 16},
            "tiers": {"enabled": True},
        }
    )
    tiers = TierIndex(l1_capacity=lambda url: 1000, l2_capacity=1000)
    router = Router(cfg, pools, PrefixIndex(), tiers=tiers)
    tokens = list(range(2000, 2100))  # 6 full blocks
    cold = await router.prepare("m", "r1", tokens, None, {})
    tiers.stored("http://d0", cold.hashes, remote=False)
    tiers.stored("http://d0", cold.hashes[:3], remote=True)
    prep = await router.prepare("m", "r2", tokens, None, {})
    holds = prep.ctx.data.get(TIERS)
    assert holds is not None
    assert holds["http://d0"] == TierHold(gpu=0, l1=96, l2=0)
    assert holds["http://d1"] == TierHold(gpu=0, l1=0, l2=48) == holds["http://p0"]
    d = router.route(prep).decision
    assert (d.path, d.decode.url, d.reason) == (Path.DIRECT, "http://d0", "prefix_in_tier")


async def test_with_tiers_off_nothing_is_published():
    router, _, _ = make()
    prep = await router.prepare("m", "r", list(range(100)), None, {})
    assert prep.ctx.data.get(TIERS) is None


async def test_an_adapters_prompt_is_hashed_with_its_name_and_path_and_matches_no_other_cache():
    router, _, index = make()
    tokens = list(range(100))
    a = await router.prepare("adpA", "r", tokens, None, {}, lora=("adpA", "/adapters/adpA"))
    assert a.ctx.adapter == "adpA"
    served(index, a, router.route(a))
    assert (await router.prepare("adpA", "r", tokens, None, {}, lora=("adpA", "/adapters/adpA"))).ctx.cached_tokens
    assert (await router.prepare("m", "r", tokens, None, {})).ctx.cached_tokens == {}  # the base model's
    other = await router.prepare("adpB", "r", tokens, None, {}, lora=("adpB", "/adapters/adpA"))
    moved = await router.prepare("adpA", "r", tokens, None, {}, lora=("adpA", "/adapters/adpA/"))
    assert other.ctx.cached_tokens == {} and moved.ctx.cached_tokens == {}  # vLLM hashes both strings


async def test_engines_lacking_an_adapter_are_left_out_unless_the_gateway_may_load_it():
    router, pools, _ = make()
    d0, d1 = pools.decode
    for ep in pools.all():
        pools.set_served(ep, frozenset({"m", "adpA"}) if ep is not d1 else frozenset({"m"}))
        ep.stats = EngineStats(0, 0, 0.0, 16, time.monotonic(), lora_slots=2, lora=True)
    tokens = list(range(20))
    fixed = await router.prepare("adpA", "r", tokens, None, {}, lora=("adpA", "/a"))
    assert {router.route(fixed).decision.decode.url for _ in range(20)} == {d0.url}
    d0.healthy = False  # the one holder gone
    with pytest.raises(NotServed):
        router.route(fixed)
    loadable = await router.prepare("adpA", "r", tokens, None, {}, lora=("adpA", "/a"), loadable=True)
    assert router.route(loadable).decision.decode.url == d1.url  # LoRA on: it can load the adapter
    pools.report(d1, EngineStats(0, 0, 0.0, 16, time.monotonic()))  # its next scrape: LoRA off there
    with pytest.raises(NotServed):
        router.route(loadable)
