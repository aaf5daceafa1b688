"""Workload generation, the run summary and the report, without processes."""

from __future__ import annotations

import itertools
import statistics

import pytest

from bench.goodput import Result, best_rates, summarize
from bench.goodput_report import markdown
from bench.workloads import VOCAB_HIGH, VOCAB_LOW, generate


def test_shapes_and_rates():
    reqs = generate("long", 2.0, 200, seed=1)
    assert 300 < len(reqs) < 500  # Poisson at 2/s over 200 s
    assert all(4096 <= len(r.prompt) <= 16384 and 256 <= r.max_tokens <= 1024 for r in reqs)
    assert all(VOCAB_LOW <= t < VOCAB_HIGH for r in reqs[:5] for t in r.prompt)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    chat = generate("chat", 5.0, 20, seed=1)
    assert all(100 <= len(r.prompt) <= 1500 and r.klass == "chat" for r in chat)
    mix = generate("mix", 5.0, 100, seed=1)
    share = sum(r.klass == "long" for r in mix) / len(mix)
    assert 0.2 < share < 0.4
    # Same arguments, same requests: every configuration replays exactly the same run.
    assert [r.prompt for r in generate("mix", 5.0, 20, seed=3)] == [r.prompt for r in generate("mix", 5.0, 20, seed=3)]
    quick = generate("long", 2.0, 50, seed=1, scale_output=0.25)
    assert all(len(r.prompt) >= 4096 and r.max_tokens <= 256 for r in quick)


def test_bursty_has_the_same_mean_and_more_spread():
    def gaps(arrivals: str) -> list[float]:
        t = [r.arrival_s for r in generate("chat", 4.0, 2000, arrivals, seed=2)]
        return [b - a for a, b in itertools.pairwise(t)]

    poisson, bursty = gaps("poisson"), gaps("bursty")
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.25)
    assert statistics.stdev(bursty) / statistics.mean(bursty) > 2 * statistics.stdev(poisson) / statistics.mean(poisson)


def test_multiturn_turns_extend_the_conversation():
    reqs = generate("multiturn", 2.0, 120, seed=4)
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    turns = next(v for v in by_session.values() if len(v) >= 3)
    for a, b in itertools.pairwise(turns):
        assert b.prompt[: len(a.prompt)] == a.prompt and b.arrival_s > a.arrival_s
    firsts = [v[0].prompt[:1024] for v in by_session.values()]
    assert all(f == firsts[0] for f in firsts)  # one shared system prompt


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
