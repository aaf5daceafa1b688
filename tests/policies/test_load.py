from __future__ import annotations

import pytest

from policies.load import Load

from .helpers import ctx, ep


def test_idle_endpoints_score_the_same():
    assert Load().score(ctx(1), [ep("a"), ep("b")]) == [1.0, 1.0]


def test_engine_reported_queue_counts_beyond_the_gateways_own_requests():
    """Another client (or another gateway replica) filled b's queue: the scraped waiting count
    makes a score lower even though this gateway has nothing in flight there."""
    scores = Load().score(ctx(1), [ep("a", in_flight=1), ep("b", waiting=6, running=8)])
    assert scores[0] > scores[1]


def test_kv_usage_counts():
    scores = Load().score(ctx(1), [ep("a", kv_usage=0.95), ep("b", kv_usage=0.1)])
    assert scores[1] > scores[0]


def test_unknown_engine_stats_do_not_penalize():
    assert Load().score(ctx(1), [ep("a", running=None), ep("b", running=0)]) == [1.0, 1.0]


def test_rejects_negative_weights():
    with pytest.raises(ValueError, match="waiting_weight: Input should be greater than or equal to 0"):
        Load(waiting_weight=-1)
    with pytest.raises(ValueError, match="kv_weight: Input should be a valid number"):
        Load(kv_weight=True)


def test_a_small_load_costs_its_share_of_the_floor_a_large_one_scales_with_the_busiest():
    one_running = Load().score(ctx(1), [ep("a", running=1), ep("b")])
    assert one_running == [1 - 0.25 / 4, 1.0]  # not [0, 1]: one running request is no reason to move
    busy = Load().score(ctx(1), [ep("a", in_flight=10), ep("b", in_flight=5)])
    assert busy == [0.0, 0.5]
    assert Load(scale_floor=0.25).score(ctx(1), [ep("a", running=1), ep("b")]) == [0.0, 1.0]
