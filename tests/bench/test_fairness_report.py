"""bench.fairness_report without processes: the Markdown table of a run (with the prefill costs it reports)."""

from __future__ import annotations

from bench.fairness_report import markdown
from bench.fairness_scoring import (
    TENANTS,
    Outcome,
    fair_shares,
    prefill_costs,
    schedule,
    summarize_tenant,
    verdict,
)


def test_prefill_costs_and_report():
    reqs = schedule(TENANTS, 5, seed=0)
    costs = prefill_costs("llama-3.3-70b-tp8-h100", reqs)
    long = max(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    assert 0.3 < costs[long] < 1.5  # a 8-16k prompt on the calibrated 70B TP8 node
    by_tenant = {}
    for spec in TENANTS:
        mine = [i for i, r in enumerate(reqs) if r.tenant == spec.name]
        outs = [Outcome(200, True, 0.5, [0.02], 2, "pd" if spec.name != "chat" else "direct") for _ in mine]
        t = summarize_tenant(spec, [reqs[i] for i in mine], outs, [costs[i] for i in mine], 5.0)
        t["gateway"] = {"queue_mean_s": 0.1}
        by_tenant[spec.name] = t
    mode = {"wall_s": 1.0, "tenants": by_tenant, "shares": fair_shares(by_tenant, {s.name: 1.0 for s in TENANTS}, 1)}
    mode["target"] = verdict(mode, TENANTS)
    result = {
        "quick": True, "profile": "p", "time_scale": 0.5, "duration_s": 5.0, "seed": 0, "output_scale": 0.5,
        "admission": {}, "tenant_specs": [s.__dict__ for s in TENANTS], "modes": {"off": mode, "on": mode},
    }  # fmt: skip
    md = markdown(result)
    assert md.count("| flood |") == 2 and "| on |" in md
