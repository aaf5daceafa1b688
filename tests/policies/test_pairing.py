"""Topology-aware pairing: the prefill engine is chosen for the decode engine already picked
(same_zone keeps the KV pull inside one availability zone, topology prefers the same network
spine), through the pipeline and through prefill failover."""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.engines.pools import Pools
from gateway.request.router import Router
from policies.base import ZONE, Path, PoolSnapshot
from policies.beliefs.prefix_index import PrefixIndex
from policies.max_score import MaxScore
from policies.pipeline import PoolPipeline, RoutingPipeline, Weighted
from policies.same_zone import SameZone
from policies.token_threshold import TokenThreshold
from policies.topology import TopologyAffinity

from .helpers import at, ctx


def pd_pipeline(strict: bool = True) -> RoutingPipeline:
    return RoutingPipeline(
        decider=TokenThreshold(threshold=5),
        decode=PoolPipeline(MaxScore()),
        prefill=PoolPipeline(
            MaxScore(),
            filters=(("same_zone", SameZone(strict=strict)),),
            scorers=(Weighted("topology", TopologyAffinity(), 1.0),),
        ),
    )


def test_the_pipeline_pairs_each_decode_engine_with_a_prefill_engine_of_its_zone():
    prefill = (at("pa1", "prefill", "a", "s2"), at("pa2", "prefill", "a", "s1"), at("pb", "prefill", "b", "s1"))
    for decode, want in ((at("da", "decode", "a", "s1"), "pa2"), (at("db", "decode", "b", "s9"), "pb")):
        d = pd_pipeline().route(ctx(50), PoolSnapshot(prefill, (decode,))).decision
        assert (d.path, d.prefill.url) == (Path.PD, want)


def test_no_prefill_engine_in_the_zone_sends_the_request_direct_and_says_why():
    pools = PoolSnapshot((at("pb", "prefill", "b"),), (at("da", "decode", "a"),))  # one candidate: no shortcut
    route = pd_pipeline().route(ctx(50), pools, explain=True)
    d = route.decision
    assert (d.path, d.reason, d.prefill) == (Path.DIRECT, "no_prefill_in_zone", None)
    assert d.detail.endswith("; no_prefill_in_zone")
    assert route.trace["prefill"] == [{"filter": "same_zone", "kept": [], "no_pairing": "no_prefill_in_zone"}]
    # not strict: the pairing across zones is made rather than none
    assert pd_pipeline(strict=False).route(ctx(50), pools).decision.prefill.url == "pb"


def test_prefill_failover_stays_in_the_decode_engines_zone(tokenizer_dir):
    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {
                "prefill": {
                    "endpoints": [
                        {"url": "http://pa1", "topology": {ZONE: "a"}},
                        {"url": "http://pa2", "topology": {ZONE: "a"}},
                        {"url": "http://pb", "topology": {ZONE: "b"}},
                    ]
                },
                "decode": {"endpoints": [{"url": "http://da", "topology": {ZONE: "a"}}]},
            },
            "routing": {
                "decider": {"name": "token_threshold", "threshold": 5},
                "prefill": {"filters": [{"name": "same_zone"}]},
            },
        }
    )
    pools = Pools(cfg.pools.prefill.urls, cfg.pools.decode.urls, topology=cfg.pools.topology)
    for e in pools.all():
        e.mark_up()
    router = Router(cfg.routing, pools, PrefixIndex())
    prep = type("Prep", (), {"ctx": ctx(50)})()
    decode = pools.decode[0].view()
    assert decode.where(ZONE) == "a"
    assert router.other(prep, "prefill", {"http://pa1"}, decode).url == "http://pa2"
    assert router.other(prep, "prefill", {"http://pa1", "http://pa2"}, decode) is None  # not pb, across zones


def test_topology_labels_are_checked_in_the_config(tokenizer_dir):
    base = {"models": [{"name": "m", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}]}
    with pytest.raises(ValueError, match="is not a Kubernetes label key"):
        parse_config({**base, "pools": {"decode": {"endpoints": [{"url": "http://d", "topology": {"bad key": "a"}}]}}})
    with pytest.raises(ValueError, match="is not a Kubernetes label value"):
        parse_config({**base, "pools": {"decode": {"endpoints": [{"url": "http://d", "topology": {ZONE: "a b"}}]}}})
    with pytest.raises(ValueError, match="is not a Kubernetes label key"):
        parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "a=b", "node_labels": ["x y"]}}}})
