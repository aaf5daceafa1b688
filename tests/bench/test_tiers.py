"""bench/tiers.py's workload and scoring (the run itself starts engines: docs/benchmarks.md)."""

from __future__ import annotations

import itertools

from bench.goodput_load import Result
from bench.tiers import Shape, summarize, workload


def test_the_workload_reuses_long_prefixes_and_is_the_same_for_both_runs():
    reqs = workload(60, 2.0, Shape(docs=3, conversations=4))
    assert workload(60, 2.0, Shape(docs=3, conversations=4)) == reqs  # one seeded PRNG
    docs = [r for r in reqs if r.klass == "doc"]
    turns = [r for r in reqs if r.klass == "turn"]
    assert docs and turns and all(6080 <= len(r.prompt) <= 8120 for r in docs)  # a 6-8k document + a question
    heads = {tuple(r.prompt[:6000]) for r in docs}
    assert len(heads) <= 3  # every question reuses one of three documents
    by_chat: dict[int, list[int]] = {}
    for r in turns:  # each turn resends the conversation so far
        before = by_chat.get(r.session)
        assert before is None or r.prompt[: len(before)] == before
        by_chat[r.session] = r.prompt
    assert all(r.arrival_s < s.arrival_s for r, s in itertools.pairwise(reqs))


def test_scoring_counts_hand_overs_and_objectives():
    reqs = workload(4, 1.0, Shape(docs=1, conversations=1))
    results = [
        Result(q.klass, True, ttft_s=5.0 if i == 0 else 0.1, path="pd" if i < 2 else "direct")
        for i, q in enumerate(reqs)
    ]
    out = summarize(True, reqs, results)
    assert out["pd"] == 2 and out["direct"] == 2 and out["failed"] == 0
    assert out["goodput"] == 0.75  # the first missed its TTFT objective
