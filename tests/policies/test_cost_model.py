from __future__ import annotations

import pytest

from policies.base import Path
from policies.cost_model import CostModel

from .helpers import ctx, ep

# 10k tokens/s everywhere, 1 MB of KV per token over 80 Gbit/s = 0.1 ms per token transferred
MODEL = CostModel(kv_bytes_per_token=1_000_000, kv_bandwidth_gbps=80, prefill_tokens_per_s=10_000,
                  pd_overhead_s=0.0)


def test_predictions_follow_the_formula():
    direct, pd = MODEL.predict(ctx(1000), ep("d", backlog_tokens=4000), ep("p", "prefill"))
    assert direct == pytest.approx((4000 + 1000) / 10_000)
    assert pd == pytest.approx(1000 / 10_000 + 1000 * 1e-4)


def test_idle_cluster_goes_direct_busy_decode_goes_pd():
    idle = MODEL.decide(ctx(1000), ep("d"), lambda: ep("p", "prefill"))
    assert idle.path is Path.DIRECT and idle.reason == "direct_faster"
    busy = MODEL.decide(ctx(1000), ep("d", backlog_tokens=20_000), lambda: ep("p", "prefill"))
    assert busy.path is Path.PD and busy.reason == "pd_faster" and "pd=" in busy.detail


def test_cached_prefix_on_decode_favours_direct():
    c = ctx(5000, cached_tokens={"d": 4992})
    choice = MODEL.decide(c, ep("d", backlog_tokens=2000), lambda: ep("p", "prefill"))
    assert choice.path is Path.DIRECT


def test_learned_prefill_speed_is_used():
    fast = ep("p", "prefill", prefill_s_per_token=1e-6)
    _, pd = MODEL.predict(ctx(1000), ep("d"), fast)
    assert pd == pytest.approx(1000 * 1e-6 + 1000 * 1e-4)
    # a decode engine not yet observed borrows the prefill engine's learned speed
    direct, _ = MODEL.predict(ctx(1000), ep("d"), fast)
    assert direct == pytest.approx(1000 * 1e-6)


def test_without_prefill_endpoint_asks_for_pd_and_lets_the_pipeline_fall_back():
    assert MODEL.decide(ctx(10), ep("d"), lambda: None).reason == "pd_unavailable"


def test_min_gain():
    m = CostModel(kv_bytes_per_token=1, prefill_tokens_per_s=1000, pd_overhead_s=0.0, min_gain_s=1.0)
    choice = m.decide(ctx(100), ep("d", backlog_tokens=500), lambda: ep("p", "prefill"))
    assert choice.path is Path.DIRECT  # P/D is 0.5 s faster, less than the 1 s it must win by


@pytest.mark.parametrize("bad", [{"kv_bandwidth_gbps": 0}, {"min_gain_s": -1}, {"kv_bytes_per_token": "x"}])
def test_rejects_bad_params(bad):
    with pytest.raises(ValueError):
        CostModel(**bad)
