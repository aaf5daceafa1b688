"""Workload files, traces and presets for the planner."""

from __future__ import annotations

import json

import pytest

from engine_model import workload


def test_presets_and_rate_scaling():
    wl = workload.load("mix")
    slow, fast = wl.jobs(1.0, 100, seed=3), wl.jobs(4.0, 25, seed=3)
    # The same requests at 4x the rate: arrivals 4x closer, nothing else changes.
    assert [(j.prompt_tokens, j.output_tokens, j.klass) for j in slow] == [
        (j.prompt_tokens, j.output_tokens, j.klass) for j in fast
    ]
    assert fast[10].arrival_s == pytest.approx(slow[10].arrival_s / 4)
    assert {j.klass for j in slow} == {"chat", "long"}
    assert wl.jobs(1.0, 100, seed=3) == slow  # seeded
    rag = workload.load("rag").jobs(2.0, 50)
    assert all(j.prefix[1] == 4000 and j.prefix[0] >= 1 for j in rag)


def test_workload_file(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text(
        "classes:\n"
        "  - {name: a, share: 3, prompt: [10, 20], output: [5, 5], ttft_s: 1, itl_p90_s: 0.05}\n"
        "  - {name: b, share: 1, prompt: [100, 100], output: [1, 2], ttft_s: 2, itl_p90_s: 0.1, itl_p99_s: 0.3}\n"
    )
    jobs = workload.load(str(f)).jobs(10, 100)
    share_a = sum(j.klass == "a" for j in jobs) / len(jobs)
    assert 0.65 < share_a < 0.85
    assert all(j.itl_p99_slo_s == 0.3 for j in jobs if j.klass == "b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("classes: []", "non-empty"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: 1}]", "missing itl_p90_s"),
        ("classes: [{prompt: [5, 2], output: [1, 1], ttft_s: 1, itl_p90_s: 1}]", "low <= high"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: 0, itl_p90_s: 1}]", "positive"),
        ("classes: [{prompt: 7, output: [1, 1], ttft_s: 1, itl_p90_s: 1}]", "prompt must be"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: 1, itl_p90_s: 1, colour: red}]", "unknown keys"),
    ],
)
def test_bad_workload_files_are_refused(tmp_path, text, message):
    f = tmp_path / "w.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        workload.load(str(f))
    with pytest.raises(ValueError, match="not a file"):
        workload.load(str(tmp_path / "missing.yaml"))


def test_traces_replay_at_their_rate_or_another(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"t": 100 + i, "prompt_tokens": 5000 if i % 2 else 300,
                                       "output_tokens": 50}) for i in range(11)))  # fmt: skip
    wl = workload.load_trace(str(f))
    assert wl.mean_rate == pytest.approx(1.0)
    own, double = wl.jobs(1.0, 100), wl.jobs(2.0, 100)
    assert [j.arrival_s for j in own][:3] == [0, 1, 2] and [j.arrival_s for j in double][:3] == [0, 0.5, 1]
    assert own[1].ttft_slo_s == 3.0 and own[0].ttft_slo_s == 1.0  # long / chat defaults by length
    f.write_text('{"t": 1, "prompt_tokens": 0, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match=">= 1"):
        workload.load_trace(str(f))
    f.write_text('{"t": 1}\n')
    with pytest.raises(ValueError, match="needs t, prompt_tokens"):
        workload.load_trace(str(f))
