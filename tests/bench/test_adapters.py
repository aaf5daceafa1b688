"""bench/adapters.py's traffic, routing configurations, scoring and plot (the run itself starts
engines: docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.adapters import (
    CONFIGS,
    TTFT_SLO,
    AdapterResult,
    adapter_names,
    gateway_config,
    make_adapters,
    routing_for,
    summarize,
    workload,
    zipf_weights,
)
from bench.adapters_plot import MISSING
from bench.adapters_plot import main as plot_main
from gateway.config import GatewayConfig


def test_zipf_weights_fall_with_rank_and_sum_to_one():
    w = zipf_weights(30, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(w))
    assert w[0] / w[1] == pytest.approx(2**1.1)
    assert zipf_weights(5, 0.0) == pytest.approx([0.2] * 5)  # s = 0: uniform


def test_the_traffic_is_skewed_like_its_zipf_weights():
    reqs = workload(3000, 5.0, 30, zipf_s=1.1)
    counts = Counter(r.adapter for r in reqs)
    names = adapter_names(30)
    weights = zipf_weights(30, 1.1)
    assert counts[names[0]] / len(reqs) == pytest.approx(weights[0], abs=0.03)  # ~29%
    head = sum(counts[n] for n in names[:3]) / len(reqs)
    assert head == pytest.approx(sum(weights[:3]), abs=0.04)  # ~51% on the top three
    assert counts[names[0]] > 5 * counts[names[15]]
    assert set(counts) <= set(names)


def test_the_traffic_is_the_same_for_a_seed_and_differs_for_another():
    a, b = workload(200, 3.0, 30), workload(200, 3.0, 30)
    assert a == b
    other = workload(200, 3.0, 30, seed=12)
    assert [r.adapter for r in other] != [r.adapter for r in a]
    assert all(x.arrival_s < y.arrival_s for x, y in itertools.pairwise(a))
    assert a[-1].arrival_s == pytest.approx(200 / 3.0, rel=0.25)  # Poisson at the rate


def test_each_adapter_has_its_own_system_prompt_and_the_lengths_are_mixed():
    reqs = workload(400, 3.0, 30)
    heads: dict[str, set[tuple[int, ...]]] = {}
    for r in reqs:
        heads.setdefault(r.adapter, set()).add(tuple(r.prompt[:600]))  # every system prompt has >= 600
    assert all(len(h) == 1 for h in heads.values())  # one system prompt per adapter
    assert len({next(iter(h)) for h in heads.values()}) == len(heads)  # and none shared
    long = [r for r in reqs if r.klass == "long"]
    chat = [r for r in reqs if r.klass == "chat"]
    assert 0.08 < len(long) / len(reqs) < 0.22
    assert all(len(r.prompt) >= 4650 for r in long) and all(len(r.prompt) <= 1900 for r in chat)
    assert all(64 <= r.max_tokens <= 256 for r in reqs)


def test_the_configurations_parse_and_differ_only_in_their_pipelines(tmp_path: Path):
    class Args:
        time_scale, max_adapters_per_engine = 0.5, 4

    paths = make_adapters(tmp_path, adapter_names(3))
    assert all(Path(p, "adapter_config.json").exists() for p in paths.values())
    engines = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    tok = tmp_path / "tok"
    cfgs = {c: GatewayConfig(**gateway_config(c, engines, 0, tok, paths, Args())) for c in CONFIGS}
    aff, rr, pre = cfgs["affinity"], cfgs["round-robin"], cfgs["prefix-only"]
    assert [s.name for s in aff.routing.decode.scorers] == ["prefix_affinity", "load", "lora_affinity"]
    assert rr.routing.decode.picker.name == "least_inflight" and not rr.routing.decode.scorers
    assert [s.name for s in pre.routing.decode.scorers] == ["prefix_affinity"]
    assert all(c.lora.dynamic_loading and c.routing.decider.name == "token_threshold" for c in cfgs.values())
    assert [a.name for a in aff.models[0].adapters] == adapter_names(3)
    with pytest.raises(ValueError):
        routing_for("random")


def _results(reqs, ttfts, engines=("e1", "e2")):
    return [
        AdapterResult(q.klass, True, ttft_s=t, engine=engines[i % len(engines)], prompt_tokens=100, cached_tokens=50)
        for i, (q, t) in enumerate(zip(reqs, ttfts, strict=True))
    ]


def test_scoring_counts_objectives_loads_per_simulated_minute_and_failures():
    reqs = workload(4, 1.0, 5)
    results = _results(reqs, [0.1, 0.2, 9.0, 0.3])
    results[3] = AdapterResult(reqs[3].klass, False, error="HTTP 404: model", status=404)
    for r in results:
        r.finished_s = 30.0  # half a simulated minute
    counts = {"engine_loads": 6, "engine_evictions": 2, "gateway_loads_ok": 4, "gateway_unloads_ok": 1}
    out = summarize("affinity", reqs, results, counts)
    assert out["failed"] == 1 and out["errors"] == {"HTTP 404: model": 1}
    assert out["goodput"] == 0.5  # 9 s misses either objective; the failed one misses too
    assert out["sim_minutes"] == 0.5
    assert out["engine_loads_per_min"] == 12.0 and out["gateway_loads_per_min"] == 8.0
    assert out["gateway_unloads"] == 1 and out["engine_evictions"] == 2
    assert out["prefix_hit_share"] == 0.5
    assert out["requests_per_engine"] == [2, 1]
    assert set(out["by_class"]) == set(TTFT_SLO)


def _doc() -> dict:
    reqs = workload(6, 1.0, 5)
    runs = []
    for k, c in enumerate(CONFIGS):
        results = _results(reqs, [0.1 * (i + 1 + k) for i in range(6)])
        for r in results:
            r.finished_s = 60.0
        runs.append(summarize(c, reqs, results, {"engine_loads": 10 + k, "gateway_loads_ok": 5 + k}))
    return {
        "profile": "p",
        "args": {"adapters": 5, "zipf": 1.1, "engines": 4, "requests": 6, "rate": 1.0},
        "runs": runs,
    }


def test_the_plot_is_drawn_from_a_saved_result(tmp_path: Path):
    pytest.importorskip("matplotlib")
    src, png = tmp_path / "adapters.json", tmp_path / "adapters.png"
    src.write_text(json.dumps(_doc()))
    assert plot_main([str(src), str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_without_matplotlib_the_bench_imports_and_the_plot_is_one_line_of_advice(tmp_path: Path):
    src = tmp_path / "adapters.json"
    src.write_text(json.dumps(_doc()))
    code = (
        "import sys; sys.modules['matplotlib'] = None; import bench.adapters, bench.adapters_plot; "
        f"sys.exit(bench.adapters_plot.main([{str(src)!r}, {str(tmp_path / 'adapters.png')!r}]))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False)
    assert out.returncode == 1 and not (tmp_path / "adapters.png").exists()
    assert out.stderr.strip().splitlines() == [MISSING]
