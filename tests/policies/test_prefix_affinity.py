from __future__ import annotations

from policies.beliefs.tiers import TIERS, TierHold
from policies.prefix_affinity import PrefixAffinity

from .helpers import ctx, ep


def test_scores_the_share_of_the_prompt_each_endpoint_holds():
    scores = PrefixAffinity().score(ctx(100, cached_tokens={"a": 64, "b": 32}), [ep("a"), ep("b"), ep("c")])
    assert scores == [0.64, 0.32, 0.0]


def test_nothing_cached_anywhere_scores_zero():
    assert PrefixAffinity().score(ctx(100), [ep("a"), ep("b")]) == [0.0, 0.0]


def test_with_tiers_an_engine_holding_the_prefix_in_its_cpu_tier_beats_one_without():
    c = ctx(1000, block_size=16)
    c.data.put(TIERS, {"a": TierHold(gpu=0, l1=992), "b": TierHold(gpu=0, l2=992), "c": TierHold(gpu=992)})
    a, b, gpu = PrefixAffinity().score(c, [ep("a"), ep("b"), ep("c")])
    assert gpu > a > b > 0  # a GPU hit first, then the own CPU tier, then the shared store
