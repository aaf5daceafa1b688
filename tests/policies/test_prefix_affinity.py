from __future__ import annotations

from policies.prefix_affinity import PrefixAffinity

from .helpers import ctx, ep


def test_scores_the_share_of_the_prompt_each_endpoint_holds():
    scores = PrefixAffinity().score(ctx(100, cached_tokens={"a": 64, "b": 32}), [ep("a"), ep("b"), ep("c")])
    assert scores == [0.64, 0.32, 0.0]


def test_nothing_cached_anywhere_scores_zero():
    assert PrefixAffinity().score(ctx(100), [ep("a"), ep("b")]) == [0.0, 0.0]
