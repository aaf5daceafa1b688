"""bench.fairness_scoring without processes: the schedule, the fair-share and attainment arithmetic."""

from __future__ import annotations

import pytest

from bench.fairness_scoring import (
    PD_THRESHOLD,
    TENANTS,
    Outcome,
    TenantSpec,
    fair_shares,
    max_min_shares,
    schedule,
    summarize_tenant,
    verdict,
)


def test_schedule_is_deterministic_and_shaped():
    a = schedule(TENANTS, 30, seed=1)
    b = schedule(TENANTS, 30, seed=1)
    assert [(r.tenant, r.arrival_s, r.prompt, r.max_tokens) for r in a] == [
        (r.tenant, r.arrival_s, r.prompt, r.max_tokens) for r in b
    ]
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert schedule(TENANTS, 30, seed=2)[0].prompt != a[0].prompt
    for spec in TENANTS:
        mine = [r for r in a if r.tenant == spec.name]
        assert 0.3 * spec.rate * 30 < len(mine) < 2 * spec.rate * 30
        assert all(spec.prompt[0] <= len(r.prompt) <= spec.prompt[1] for r in mine)
        assert all(spec.output[0] <= r.max_tokens <= spec.output[1] for r in mine)
        # the path is fixed by the prompt: chat direct, the others P/D
        assert all((len(r.prompt) >= PD_THRESHOLD) == (spec.name != "chat") for r in mine)
    # One PRNG per tenant: changing the flood's rate leaves the others' requests alone.
    calmer = tuple(TenantSpec(**{**s.__dict__, "rate": 1.0}) if s.flood else s for s in TENANTS)
    assert [r.prompt for r in schedule(calmer, 30, seed=1) if r.tenant == "chat"] == [
        r.prompt for r in a if r.tenant == "chat"
    ]
    assert all(r.max_tokens <= 100 for r in schedule(TENANTS, 10, seed=1, scale_output=0.5) if r.tenant == "chat")


def test_max_min_shares():
    w = {"a": 1.0, "b": 1.0, "c": 1.0}
    # Everyone under an equal share: all get what they ask.
    assert max_min_shares({"a": 1, "b": 2, "c": 3}, w, 10) == pytest.approx({"a": 1, "b": 2, "c": 3})
    # The flood gets what the others leave.
    assert max_min_shares({"a": 1, "b": 2, "c": 30}, w, 10) == pytest.approx({"a": 1, "b": 2, "c": 7})
    # Two over their share split the rest by weight.
    got = max_min_shares({"a": 1, "b": 20, "c": 30}, {"a": 1.0, "b": 1.0, "c": 2.0}, 10)
    assert got == pytest.approx({"a": 1, "b": 3, "c": 6})
    assert max_min_shares({"a": 0, "b": 5}, {"a": 1.0, "b": 1.0}, 1) == pytest.approx({"a": 0, "b": 1})


def _tenant(name: str, slo: float, ttfts: list[float | None], prompt: int = 5000) -> dict:
    spec = TenantSpec(name, 1.0, (prompt, prompt), (10, 10), slo, flood=name == "flood")
    reqs = schedule((spec,), 100, seed=0)[: len(ttfts)]
    outs = [Outcome(429, error="HTTP 429") if t is None else Outcome(200, True, t, [0.02] * 9, 10, "pd") for t in ttfts]
    for r in reqs:
        r.arrival_s = 1.0
    return summarize_tenant(spec, reqs, outs, [0.25] * len(reqs), 10.0)


def test_attainment_goodput_and_shares():
    rag = _tenant("rag", 4.0, [1.0, 2.0, 5.0, None])  # 2 of 4 meet the SLO; the 429 counts as missed
    assert rag["attainment"] == 0.5 and rag["rejected_429"] == 1 and rag["errors"] == 0
    assert rag["goodput_req_s"] == pytest.approx(0.2) and rag["goodput_tok_s"] == pytest.approx(2.0)
    assert rag["offered_pool_s"] == pytest.approx(0.1)  # 4 x 0.25 s of prefill over 10 s
    assert rag["pool_s"] == pytest.approx(0.075)  # the 3 served, first tokens within the window
    flood = _tenant("flood", 30.0, [1.0] * 40 + [9.5] * 4)  # the last 4 first-token after the window
    assert flood["pool_s"] == pytest.approx(1.0) and flood["offered_pool_s"] == pytest.approx(1.1)
    shares = fair_shares({"rag": rag, "flood": flood}, {"rag": 1.0, "flood": 1.0}, 1)
    assert shares["rag"]["pool_fair"] == pytest.approx(0.1)
    assert shares["flood"]["pool_fair"] == pytest.approx(0.9)
    assert shares["flood"]["pool_served_over_fair"] == pytest.approx(1.111, abs=1e-3)
    mode = {"tenants": {"rag": rag, "flood": flood, "chat": rag}, "shares": {**shares, "chat": shares["rag"]}}
    assert verdict(mode, TENANTS) == {"well_behaved_attainment_ok": False, "flood_share_ok": True}
