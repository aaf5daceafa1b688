"""bench.crossover's bookkeeping: the SLOs judged on one run, the capacity search, the crossover."""

from __future__ import annotations

from bench import crossover
from engine_model import profile
from engine_model.fleet import Layout


def test_one_run_judged_on_three_slos_and_a_capacity_found():
    settings = profile.engine_settings("llama-3.3-70b-tp8-h100")
    wl = crossover.mix(16384)
    colo = crossover.capacity(settings, Layout(0, 2, "colocated"), wl, 20.0, 0)
    pd = crossover.capacity(settings, Layout(1, 1, "threshold", 14000), wl, 20.0, 0)
    for c in (colo, pd):
        cap = c["capacity"]
        assert cap["tight"] <= cap["tail"] <= cap["standard"]  # each SLO adds to the one before
        assert all(0 <= p["tight"] <= p["tail"] <= p["standard"] <= 1 for p in c["points"])
    # 30% of requests with 16k prompts: their chunks stall colocated streams past a 100 ms p99 gap
    assert pd["capacity"]["tail"] > colo["capacity"]["tail"]


def test_crossover_lists_the_lengths_where_pd_holds_more():
    def row(length: int, h: int, pd: float, best: float) -> dict:
        cap = {slo: pd for slo in crossover.SLOS}
        return {"length": length, "handover_ms": h, "pd": {"capacity": cap},
                "best_colocated_capacity": {slo: best for slo in crossover.SLOS}}  # fmt: skip

    rows = [row(1024, 20, 9, 8), row(4096, 20, 3, 4), row(16384, 20, 3, 1), row(1024, 300, 8, 8),
            row(4096, 300, 4, 4), row(16384, 300, 2, 1)]  # fmt: skip
    out = crossover.crossover(rows)["tail"]
    assert [c["length"] for c in out["20"]] == [1024, 16384]  # not at 4k: its prefill engine saturates first
    assert out["300"] == [{"length": 16384, "pd": 2, "colocated": 1}]
