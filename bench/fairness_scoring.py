"""The tenants of the fairness benchmark (:mod:`bench.fairness`) and its arithmetic: who sends what
when (a seeded schedule), weighted max-min fair shares of the prefill pool, each tenant's SLO
attainment, goodput and prefill-pool use, and the verdict against the targets.

Pure functions of the schedule and the outcomes, apart from the processes, so that they are tested
without them and a saved run's JSON can be re-scored (``--report``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from bench.goodput_metrics import pct
from bench.workloads import _arrival_times, _ids
from engine_model.config import SimConfig
from engine_model.profile import engine_settings

MODES = ("off", "on")
ITL_P90_SLO_S = 0.050  # bench.goodput's ITL objective, for the stricter attainment column
TARGET_ATTAINMENT = 0.95  # the well-behaved tenants, fairness on
SHARE_TOLERANCE = 0.95  # the flood must get at least this fraction of its fair share of what the pool delivered
POOL_BUSY_TARGET = 0.9  # ... and the pool must deliver this fraction of its modelled capacity (no idle room)
PD_THRESHOLD = 4096


@dataclass(frozen=True)
class TenantSpec:
    name: str
    rate: float  # simulated requests/s
    prompt: tuple[int, int]
    output: tuple[int, int]
    ttft_slo_s: float  # simulated
    weight: float = 1.0
    flood: bool = False


TENANTS = (
    TenantSpec("chat", 2.0, (100, 500), (100, 200), 1.0),
    TenantSpec("rag", 0.5, (4608, 8000), (100, 300), 4.0),
    TenantSpec("flood", 2.5, (8192, 16384), (16, 64), 30.0, flood=True),
)


@dataclass
class TenantRequest:
    tenant: str
    arrival_s: float  # simulated, since the run's start
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    status: int = 0
    ok: bool = False
    ttft_s: float = 0.0  # simulated
    itls_s: list[float] = field(default_factory=list)
    tokens: int = 0
    path: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------- schedule
def schedule(
    specs: tuple[TenantSpec, ...], duration_s: float, seed: int = 0, scale_output: float = 1.0
) -> list[TenantRequest]:
    """Every tenant's requests, merged by arrival. One PRNG per tenant, so a tenant's requests do
    not change when another tenant's rate does; the same arguments give the same requests."""
    out: list[TenantRequest] = []
    for spec in specs:
        rng = random.Random(f"fairness/{spec.name}/{spec.rate}/{seed}")
        for t in _arrival_times(rng, spec.rate, duration_s, "poisson"):
            n = rng.randint(*spec.prompt)
            m = max(2, round(rng.randint(*spec.output) * scale_output))
            out.append(TenantRequest(spec.name, t, _ids(rng, n), m))
    out.sort(key=lambda r: (r.arrival_s, r.tenant))
    return out


# ---------------------------------------------------------------------------- arithmetic
def max_min_shares(demands: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair allocation (water-filling): no tenant gets more than it asks; what a
    tenant leaves unused is split among the rest by weight."""
    share = {t: 0.0 for t in demands}
    active = {t for t, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-12:
        total_w = sum(weights[t] for t in active)
        fill = {t: left * weights[t] / total_w for t in active}
        sated = {t for t in active if demands[t] - share[t] <= fill[t]}
        if not sated:
            for t in active:
                share[t] += fill[t]
            break
        for t in sated:
            left -= demands[t] - share[t]
            share[t] = demands[t]
        active -= sated
    return share


def attainment(met: int, total: int) -> float:
    """Share of all requests (failed ones count as missed) that met the SLO."""
    return round(met / total, 3) if total else 0.0


def prefill_costs(profile: str, reqs: list[TenantRequest]) -> list[float]:
    """Each request's prefill time alone on one engine of the profile (simulated s): what it asks
    of the prefill pool. Engine time, not tokens, since a long prompt's later chunks cost more."""
    cfg = SimConfig(**{**engine_settings(profile), "time_scale": 1.0})
    return [cfg.prefill_time(len(q.prompt)) for q in reqs]


def summarize_tenant(
    spec: TenantSpec, reqs: list[TenantRequest], outs: list[Outcome], costs: list[float], duration_s: float
) -> dict[str, Any]:
    """One tenant's figures for one mode (simulated seconds). ``costs``: each request's
    :func:`prefill_costs`; the prefill pool's are the P/D requests' (prompt >= the threshold)."""
    ok = [(q, o) for q, o in zip(reqs, outs, strict=True) if o.ok]
    pool_in_window = [
        c for q, o, c in zip(reqs, outs, costs, strict=True)
        if o.ok and o.path == "pd" and q.arrival_s + o.ttft_s <= duration_s
    ]  # fmt: skip
    met_ttft = [(q, o) for q, o in ok if o.ttft_s <= spec.ttft_slo_s]
    met_slo = [(q, o) for q, o in met_ttft if (pct(o.itls_s, 0.9) or 0.0) <= ITL_P90_SLO_S]
    in_window = [q for q, o in ok if q.arrival_s + o.ttft_s <= duration_s]
    ttfts = [o.ttft_s for _, o in ok]
    paths: dict[str, int] = {}
    for _, o in ok:
        paths[o.path or "?"] = paths.get(o.path or "?", 0) + 1

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(reqs),
        "completed": len(ok),
        "rejected_429": sum(o.status == 429 for o in outs),
        "errors": sum(not o.ok and o.status != 429 for o in outs),
        "error_samples": sorted({o.error for o in outs if o.error and o.status != 429})[:3],
        "ttft_slo_s": spec.ttft_slo_s,
        "attainment": attainment(len(met_ttft), len(reqs)),
        "attainment_with_itl": attainment(len(met_slo), len(reqs)),
        "goodput_req_s": round(len(met_ttft) / duration_s, 3),
        "goodput_tok_s": round(sum(o.tokens for _, o in met_ttft) / duration_s, 1),
        "offered_prefill_tok_s": round(sum(len(q.prompt) for q in reqs) / duration_s, 1),
        "prefill_tok_s": round(sum(len(q.prompt) for q in in_window) / duration_s, 1),
        "output_tok_s": round(sum(o.tokens for _, o in ok) / duration_s, 1),
        "offered_pool_s": round(
            sum(c for q, c in zip(reqs, costs, strict=True) if len(q.prompt) >= PD_THRESHOLD) / duration_s, 4
        ),
        "pool_s": round(sum(pool_in_window) / duration_s, 4),
        "ttft_ms": {f"p{q}": ms(pct(ttfts, q / 100)) for q in (50, 90, 99)},
        "paths": paths,
        "ttfts_ms": sorted(round(t * 1000, 1) for t in ttfts),  # for the CDF plot
    }


def fair_shares(
    tenants: dict[str, dict[str, Any]], weights: dict[str, float], pool_engines: int
) -> dict[str, dict[str, float]]:
    """Per tenant, its weighted max-min fair share next to what it was served, two ways:
    ``pool_*``: the prefill pool's engine time (capacity: its engines, busy every second),
    given what its P/D requests ask of it; ``tok_*``: all prefill tokens served in the window, on
    any engine and path (capacity: that run's total, so a tenant's shortfall there only shows
    what others took, not capacity left idle)."""
    tok_capacity = sum(t["prefill_tok_s"] for t in tenants.values())
    # What the pool delivered in the window (its engines ran behind their modelled step times on
    # these loaded cores, and legs running at the window's end are not counted): the flood's share
    # of that is what fairness decides; whether the pool sat idle is ``pool_delivered`` below.
    delivered = sum(t["pool_s"] for t in tenants.values())
    fair_of_delivered = max_min_shares({n: t["offered_pool_s"] for n, t in tenants.items()}, weights, delivered)
    tok_fair = max_min_shares({n: t["offered_prefill_tok_s"] for n, t in tenants.items()}, weights, tok_capacity)
    pool_fair = max_min_shares({n: t["offered_pool_s"] for n, t in tenants.items()}, weights, float(pool_engines))
    out = {}
    for n, t in tenants.items():
        out[n] = {
            "pool_served": t["pool_s"],
            "pool_fair": round(pool_fair[n], 4),
            "pool_served_over_fair": round(t["pool_s"] / pool_fair[n], 3) if pool_fair[n] else None,
            "pool_fair_of_delivered": round(fair_of_delivered[n], 4),
            "pool_served_over_fair_of_delivered": round(t["pool_s"] / fair_of_delivered[n], 3)
            if fair_of_delivered[n]
            else None,
            "pool_delivered": round(delivered / pool_engines, 3),
            "tok_served": t["prefill_tok_s"],
            "tok_fair": round(tok_fair[n], 1),
            "tok_served_fraction": round(t["prefill_tok_s"] / tok_capacity, 3) if tok_capacity else 0.0,
            "tok_fair_fraction": round(tok_fair[n] / tok_capacity, 3) if tok_capacity else 0.0,
        }
    return out


def verdict(mode: dict[str, Any], specs: tuple[TenantSpec, ...]) -> dict[str, Any]:
    """The issue's target: every well-behaved tenant >= 95% attainment, the flood >= its share."""
    good = {s.name: mode["tenants"][s.name]["attainment"] for s in specs if not s.flood}
    flood = {s.name: mode["shares"][s.name] for s in specs if s.flood}
    return {
        "well_behaved_attainment_ok": all(a >= TARGET_ATTAINMENT for a in good.values()),
        "flood_share_ok": all(
            (sh["pool_served_over_fair_of_delivered"] or 0) >= SHARE_TOLERANCE
            and sh["pool_delivered"] >= POOL_BUSY_TARGET
            for sh in flood.values()
        ),
    }
