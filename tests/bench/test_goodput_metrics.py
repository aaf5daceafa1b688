"""bench.goodput_metrics: one point's SLO attainment and goodput, and the best rates of a sweep (and
their report)."""

from __future__ import annotations

from bench.goodput_load import Result
from bench.goodput_metrics import best_rates, summarize
from bench.goodput_report import markdown
from bench.workloads import generate


def test_summary_slo_and_goodput():
    reqs = generate("chat", 1.0, 10, seed=5)[:4]
    ok = [
        Result("chat", True, 0.5, [0.02] * 9, 10, 5.0),
        Result("chat", True, 1.5, [0.02] * 9, 10, 6.0),
        Result("chat", True, 0.2, [0.02] * 5 + [0.3] * 4, 10, 7.0),
        Result("chat", False, error="HTTP 500"),
    ]
    s = summarize(reqs, ok, 10.0, 2.0)
    assert (s["completed"], s["failed"], s["slo_met"]) == (3, 1, 1)  # slow TTFT, stalled ITL, failure
    assert s["goodput_req_s"] == 0.5 and s["attainment"] == 0.25
    assert s["errors"] == ["HTTP 500"]
    points = [{"config": "a", "workload": "chat", "arrivals": "poisson", "rate": r, "attainment": a,
               "goodput_req_s": g, **{k: s[k] for k in ("ttft_ms", "itl_ms", "throughput_tok_s", "failed", "paths")}}
              for r, a, g in ((1.0, 1.0, 1.0), (2.0, 0.95, 1.9), (4.0, 0.5, 2.0))]  # fmt: skip
    (best,) = best_rates(points)
    assert best["max_rate_at_slo"] == 2.0 and best["max_goodput_req_s"] == 2.0
    md = markdown({"profile": "p", "engines": 2, "time_scale": 0.5, "duration_s": 10.0, "points": points,
                   "best": [best]})  # fmt: skip
    assert "| chat | poisson | 2 | a |" in md and "| chat | poisson | 2 (2) |" in md
