"""The token threshold decider: P/D from ``threshold`` prompt tokens not cached on the decode engine."""

from __future__ import annotations

import pytest

from policies.base import Path
from policies.token_threshold import TokenThreshold

from .helpers import ctx, ep, no_prefill


def test_token_threshold_boundary():
    policy = TokenThreshold(threshold=100)
    assert policy.decide(ctx(99), ep("d0"), no_prefill).path is Path.DIRECT
    choice = policy.decide(ctx(100), ep("d0"), no_prefill)
    assert choice.path is Path.PD
    assert choice.reason == "long_uncached" and choice.detail == "uncached=100>=100"


def test_token_threshold_counts_only_uncached_tokens_on_the_decode_endpoint():
    policy = TokenThreshold(threshold=100)
    c = ctx(150, cached_tokens={"d0": 96, "d1": 16})
    held = policy.decide(c, ep("d0"), no_prefill)
    assert held.path is Path.DIRECT and held.reason == "prefix_cached"
    assert "uncached=54<100" in held.detail
    assert policy.decide(c, ep("d1"), no_prefill).path is Path.PD  # 134 uncached there


def test_token_threshold_default_is_4096():
    assert TokenThreshold().threshold == 4096


@pytest.mark.parametrize("bad", [0, -1, "4096", True, 1.5])
def test_token_threshold_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        TokenThreshold(threshold=bad)
