"""The planner: its analytical model, its search against brute-force simulation, its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_model import planner, profile, workload
from engine_model.fleet import Layout
from engine_model.planner import Candidate

H100 = profile.engine_settings("llama-3.3-70b-tp8-h100")


def test_the_model_sees_load_and_interference():
    jobs1 = workload.load("mix").jobs(2.0, 120, seed=0)
    jobs4 = workload.load("mix").jobs(8.0, 30, seed=0)  # the same requests, 4x the rate
    colo1 = Candidate(Layout(0, 1, "colocated"))
    pd = Candidate(Layout(1, 1, "threshold", 4096))
    a = planner.estimate(H100, colo1, jobs1, 120, tail=False)
    b = planner.estimate(H100, colo1, jobs4, 30, tail=False)
    assert a.attainment > b.attainment  # more load, fewer within the SLO
    # The tail SLO (p99 ITL) is where long prompts' chunks hurt a colocated engine, not P/D's decode pool.
    assert planner.estimate(H100, colo1, jobs1, 120, tail=True).attainment < 0.6
    assert planner.estimate(H100, pd, jobs1, 120, tail=True).attainment > 0.95
    # Far past capacity: overloaded, nothing met.
    over = planner.estimate(H100, colo1, workload.load("long").jobs(20.0, 10), 10, tail=False)
    assert over.attainment == 0 and over.notes == "overloaded"


def test_plan_matches_brute_force_on_a_small_fleet():
    """Up to 3 engines, every layout simulated: the plan's split is within one engine of the best."""
    jobs = workload.load("mix").jobs(3.0, 40, seed=2)
    p = planner.plan(H100, jobs, 40, tail=True, max_engines=3, check=4)
    assert p.recommended is not None
    est, res = p.recommended
    best, best_res = planner.brute_force(H100, jobs, 40, planner.candidates(3, (4096,)), tail=True)[0]
    assert best_res.attainment(tail=True) >= 0.9
    assert abs(est.candidate.layout.prefill - best.layout.prefill) <= 1
    assert abs(est.candidate.layout.decode - best.layout.decode) <= 1
    assert res.attainment(tail=True) >= 0.9 and est.candidate.engines <= best.engines + 1


def test_cli_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "plan.json", tmp_path / "plan.md"
    argv = [sys.executable, "-m", "gateway", "plan", "--workload", "chat", "--rate", "2,6", "--max-engines", "2",
            "--duration", "20", "--check", "2", "--engine-hour-cost", "98.32",
            "--out", str(out), "--markdown", str(md)]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [p["rate"] for p in doc["plans"]] == [2, 6]  # the rates asked for, not the sampled arrivals'
    assert all(p["sampled_rate"] != p["rate"] for p in doc["plans"])  # (which this seed draws differently)
    assert all(c["simulated_goodput_req_s"] <= p["rate"] for p in doc["plans"] for c in p["checked"])
    rec = doc["plans"][0]["recommended"]
    assert rec["engines"] >= 1 and rec["cost_per_hour"] == round(rec["engines"] * 98.32, 2)
    assert rec["simulated_attainment"] >= 0.9
    assert doc["slos"] == [{"class": "chat", "ttft_s": 1.0, "itl_p90_s": 0.05, "itl_p99_s": 0.1}]
    text = md.read_text()
    assert "**Recommended:**" in text and "req/s:" in r.stderr
    assert text.startswith("# Plan: 2 req/s,") and "\n# Plan: 6 req/s," in text
    # What was planned for is in the report: the profile, the workload, each class's SLO.
    assert "profile `llama-3.3-70b-tp8-h100`" in text and "Workload `chat`" in text
    assert "- chat: TTFT <= 1 s, p90 of its own inter-token gaps <= 50 ms" in text
    assert "ITL p90 (p90)" not in text and "streams' p90 gap, p90 ms" in text
    assert [line.split(": ")[0] for line in r.stderr.splitlines() if "req/s:" in line] == ["2 req/s", "6 req/s"]


def test_layouts_name_the_gateways_decider_and_threshold():
    """A P/D layout says which routing rule it needs, as the gateway's config spells it (issue 28:
    ">= 2048 tokens" named neither the decider nor which tokens)."""
    pd = Candidate(Layout(1, 2, "threshold", 2048))
    assert pd.name == "1P+2D (token_threshold 2048: P/D from 2048 prompt tokens)"
    assert pd.decider == {"name": "token_threshold", "threshold": 2048}
    always = Candidate(Layout(2, 1, "always"))
    assert always.name == "2P+1D (token_threshold 1: every request through P/D)"
    assert always.decider == {"name": "token_threshold", "threshold": 1}
    colo = Candidate(Layout(0, 2, "colocated"), chunk=2048)
    assert colo.name == "colocated x2, 2048-token chunks" and colo.decider is None
    # The JSON's recommendation carries the decider to copy into routing.decider.
    jobs = workload.load("mix").jobs(2.0, 30, seed=0)
    doc = planner.to_json(planner.plan(H100, jobs, 30, tail=True, max_engines=2, check=2, rate=2.0))
    assert doc["rate"] == 2.0 and doc["sampled_rate"] == round(len(jobs) / 30, 3) != 2.0
    rec = doc["recommended"]
    assert rec["prefill_engines"] == 1 and rec["decider"] == {"name": "token_threshold", "threshold": 2048}


def test_cli_refuses_bad_input(tmp_path):
    for args, message in (
        (["--max-engines", "0"], "--max-engines"),
        (["--workload", "nope"], "not a file"),
        (["--slos", "mix"], "--slos goes with --trace"),
        (["--rate", "-1"], "positive"),
        (["--target", "2"], "share"),
    ):
        r = subprocess.run([sys.executable, "-m", "gateway", "plan", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_small_check_budgets_simulate_the_likely_answer_first_and_json_is_finite():
    jobs = workload.load("mix").jobs(4.0, 40, seed=2)
    p = planner.plan(H100, jobs, 40, tail=True, max_engines=4, check=1)
    assert len(p.checked) == 1 and p.recommended is not None  # the cheapest the model expects to pass
    doc = planner.to_json(planner.plan(H100, jobs, 40, tail=True, max_engines=3, check=3))
    json.dumps(doc, allow_nan=False)  # failed requests leave no infinity in the report


def test_a_short_trace_is_planned_at_its_own_rate(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"t": i * 0.5, "prompt_tokens": 800, "output_tokens": 50})
                               for i in range(61)))  # fmt: skip  # 30 s at 2 req/s
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "gateway", "plan", "--trace", str(trace), "--duration", "120",
                        "--max-engines", "2", "--check", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["plans"][0]["rate"] == pytest.approx(2.0, rel=0.05)
