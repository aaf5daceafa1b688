from __future__ import annotations

import re

import pytest

from policies.base import Path
from policies.cost_model import CostModel

from .helpers import ctx, ep

# 10k tokens/s everywhere, 1 MB of KV per token over 80 Gbit/s = 0.1 ms per token transferred
MODEL = CostModel(kv_bytes_per_token=1_000_000, kv_bandwidth_gbps=80, prefill_tokens_per_s=10_000, pd_overhead_s=0.0)


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


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"kv_bandwidth_gbps": 0}, "kv_bandwidth_gbps: Input should be greater than 0"),
        ({"min_gain_s": -1}, "min_gain_s: Input should be greater than or equal to 0"),
        ({"kv_bytes_per_token": "x"}, "kv_bytes_per_token: Input should be a valid number"),
        ({"itl_budget_s": True}, "itl_budget_s: Input should be a valid number"),
        ({"itl_budget": 0}, "itl_budget: unknown parameter (did you mean 'itl_budget_s'?)"),
    ],
)
def test_rejects_bad_params(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CostModel(**bad)


def test_zero_itl_budget_is_accepted():
    assert CostModel(itl_budget_s=0).itl_budget_s == 0


def test_a_direct_prefill_that_would_stall_running_streams_goes_pd():
    prefill = lambda: ep("p", "prefill")  # noqa: E731
    # 1000 uncached tokens at 10k tokens/s: one 100 ms prefill step on the decode engine.
    quiet = MODEL.decide(ctx(1000), ep("d", running=0), prefill)
    assert quiet.path is Path.DIRECT and quiet.reason == "direct_faster"  # nobody to stall
    busy = MODEL.decide(ctx(1000), ep("d", running=4), prefill)
    assert busy.path is Path.PD and busy.reason == "protect_itl" and "stall 4 stream(s) 100ms" in busy.detail
    short = MODEL.decide(ctx(300), ep("d", running=4), prefill)  # a 30 ms step: within the budget
    assert short.path is Path.DIRECT
    # Engine metrics stale: the gateway's own open requests there stand for its streams.
    assert MODEL.decide(ctx(1000), ep("d", in_flight=2), prefill).reason == "protect_itl"
    ttft_only = CostModel(
        kv_bytes_per_token=1_000_000,
        kv_bandwidth_gbps=80,
        prefill_tokens_per_s=10_000,
        pd_overhead_s=0.0,
        itl_budget_s=0,
    )
    assert ttft_only.decide(ctx(1000), ep("d", running=4), prefill).path is Path.DIRECT


def test_sparing_streams_is_not_worth_any_wait_in_the_prefill_queue():
    # 1000 tokens: direct 100 ms, and one 100 ms step for each of 4 streams (400 ms in all).
    backed_up = lambda: ep("p", "prefill", backlog_tokens=20_000)  # noqa: E731  # 2 s queued there
    choice = MODEL.decide(ctx(1000), ep("d", running=4), backed_up)
    assert choice.path is Path.DIRECT and choice.reason == "prefill_backlog"
    assert "P/D would add 2100ms > 400ms spared" in choice.detail
    # 40 streams: 4 s of their time spared is worth this request's 2.1 s.
    assert MODEL.decide(ctx(1000), ep("d", running=40), backed_up).reason == "protect_itl"


def test_one_chunk_bounds_the_stall():
    m = CostModel(prefill_tokens_per_s=100_000, prefill_chunk_tokens=2048, itl_budget_s=0.05)
    assert m.stall_s(ctx(50_000), ep("d"), ep("p", "prefill")) == pytest.approx(2048 / 100_000)
