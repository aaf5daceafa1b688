"""Engine speeds measured on real requests through the lifecycle hooks: prefill seconds per token
from prefill legs, and the P/D hand-over (prefill answer to decode first token) per pair."""

from __future__ import annotations

import pytest

from policies.base import MEASURED, EndpointView, LegOutcome, LegReport, Path, RequestContext
from policies.beliefs.estimates import MIN_HANDOVER_SAMPLES, EngineEstimates, LinearFit
from policies.cost_model import CostModel

P, P2, D = "http://p", "http://p2", "http://d"


def prompt(n: int) -> RequestContext:
    return RequestContext("m", "r", list(range(n)))


def prefill_leg(
    seconds: float, uncached: int, *, queued: int = 0, cached: int | None = None, outcome: LegOutcome = LegOutcome.OK
) -> LegReport:
    return LegReport(
        "prefill", P, outcome, Path.PD, seconds, uncached_tokens=uncached, queued_tokens=queued, cached_tokens=cached
    )


def handover_leg(prefill: str, tokens: int, first_token_s: float) -> LegReport:
    return LegReport(
        "decode",
        D,
        LegOutcome.OK,
        Path.PD,
        first_token_s + 1.0,
        first_token_s=first_token_s,
        uncached_tokens=tokens,
        prefill_url=prefill,
    )


def test_prefill_speed_counts_the_queue_ahead_and_the_engines_own_cache_hit():
    est = EngineEstimates()
    est.on_leg_done(prompt(1000), prefill_leg(1.0, 1000, queued=1000))
    assert est.prefill_s_per_token(P) == pytest.approx(1.0 / 2000)
    est = EngineEstimates()
    # The gateway believed nothing cached; the engine says 600 of 1000 were: 400 computed.
    est.on_leg_done(prompt(1000), prefill_leg(0.4, 1000, cached=600))
    assert est.prefill_s_per_token(P) == pytest.approx(0.4 / 400)


def test_failed_legs_and_tiny_prompts_teach_no_speed():
    est = EngineEstimates()
    est.on_leg_done(prompt(1000), prefill_leg(5.0, 1000, outcome=LegOutcome.FAILED))
    est.on_leg_done(prompt(10), prefill_leg(0.01, 10))
    assert est.prefill_s_per_token(P) is None


def test_handover_is_measured_per_pair_then_across_the_pool():
    est = EngineEstimates()
    for _ in range(MIN_HANDOVER_SAMPLES - 1):
        est.on_leg_done(prompt(2000), handover_leg(P, 2000, 0.2))
    assert est.handover(P, D, 2000, 0.0) is None  # too few samples to trust
    est.on_leg_done(prompt(2000), handover_leg(P, 2000, 0.2))
    got = est.handover(P, D, 2000, 0.0)
    assert got is not None and got.source == "pair" and got.seconds == pytest.approx(0.2)
    pooled = est.handover(P2, D, 2000, 0.0)  # a pair never measured: what the pool shows
    assert pooled is not None and pooled.source == "pool"
    est.forget(P)
    assert est.handover(P, D, 2000, 0.0).source == "pool"


def test_handover_slope_is_fitted_once_sizes_spread_else_the_prior():
    fit = LinearFit()
    for tokens in (1000, 4000, 2000, 8000, 500, 6000):
        fit.add(tokens, 0.05 + tokens * 1e-5)  # 50 ms fixed + 10 us per token
    assert fit.predict(3000, prior_slope=0.0) == pytest.approx(0.05 + 0.03, rel=0.05)
    same = LinearFit()
    for _ in range(6):
        same.add(2000, 0.1)
    assert same.predict(2000, prior_slope=1e-5) == pytest.approx(0.1)
    assert same.predict(4000, prior_slope=1e-5) == pytest.approx(0.12)  # the prior slope, anchored on the data


def test_the_cost_model_uses_the_measured_handover_and_says_so():
    model = CostModel(kv_bandwidth_gbps=400, pd_overhead_s=0.005, itl_budget_s=0, decode_prefill_factor=2)
    decode, prefill = EndpointView(D, "decode", True, 0), EndpointView(P, "prefill", True, 0)
    est = EngineEstimates()
    ctx = RequestContext("m", "r", list(range(4000)))
    ctx.data.put(MEASURED, est)  # as the router publishes it
    configured = model.decide(ctx, decode, lambda: prefill)
    assert "configured" in configured.detail
    for _ in range(MIN_HANDOVER_SAMPLES):  # the real hand-over is far slower than the link says
        est.on_leg_done(ctx, handover_leg(P, 4000, 2.0))
    measured = model.decide(ctx, decode, lambda: prefill)
    assert "measured on the pair, n=3" in measured.detail
    assert dict(measured.predicted_ttft)["pd"] == pytest.approx(
        dict(configured.predicted_ttft)["pd"] - model.transfer_s(4000) - 0.005 + 2.0
    )
    assert (configured.path, measured.path) == (Path.PD, Path.DIRECT)
