"""bench/tiers.py's workload, scoring and plot (the run itself starts engines: docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.goodput_load import Result
from bench.tiers import Shape, summarize, workload
from bench.tiers_plot import main as plot_main


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


def _result() -> dict:
    reqs = workload(6, 1.0, Shape(docs=1, conversations=1))
    runs = [
        summarize(tiers, reqs, [Result(q.klass, True, ttft_s=0.1 * (i + 1), path="pd" if i < 2 else "direct")
                                for i, q in enumerate(reqs)])
        for tiers in (False, True)
    ]  # fmt: skip
    return {"profile": "p", "args": {"requests": 6, "rate": 1.0}, "runs": runs}


def test_the_plot_is_drawn_from_a_saved_result(tmp_path: Path):
    pytest.importorskip("matplotlib")
    src, png = tmp_path / "tiers.json", tmp_path / "tiers.png"
    src.write_text(json.dumps(_result()))
    assert plot_main([str(src), str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_without_matplotlib_the_bench_imports_and_the_plot_is_one_line_of_advice(tmp_path: Path):
    src = tmp_path / "tiers.json"
    src.write_text(json.dumps(_result()))
    code = (
        "import sys; sys.modules['matplotlib'] = None; import bench.tiers, bench.tiers_plot; "
        f"sys.exit(bench.tiers_plot.main([{str(src)!r}, {str(tmp_path / 'tiers.png')!r}]))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert out.returncode == 1 and not (tmp_path / "tiers.png").exists()
    assert out.stderr.strip().splitlines() == ["matplotlib missing: install the bench extra: pip install -e '.[bench]'"]
