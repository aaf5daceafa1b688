"""Workload generation (bench.workloads) without processes: shapes, rates, bursts, multi-turn."""

from __future__ import annotations

import itertools
import statistics

import pytest

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
