"""End to end: a gateway with its live planner on publishes, from the traffic it served, the
engines each pool needs (pdgate_pool_desired_engines), for one worker and summed over two."""

from __future__ import annotations

import httpx
import pytest

from tests.procs import ProcGroup, wait_for
from tests.promtext import sample

from .cluster import Cluster

pytestmark = pytest.mark.e2e
THRESHOLD = 200
LONG = "Summarize the incident log: " + "the decode pool kept streaming while prefill ran elsewhere. " * 40


@pytest.mark.parametrize("workers", [1, 2])
def test_desired_engines_follow_the_traffic(tokenizer_dir, tmp_path, workers):
    group = ProcGroup(tmp_path)
    c = Cluster(group, tokenizer_dir)
    try:
        c.prefill.append(c.start_sim("prefill"))
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(THRESHOLD, server={"workers": workers},
                        planner={"enabled": True, "interval_s": 1, "window_s": 60})  # fmt: skip
        metrics = lambda: httpx.get(c.url + "/metrics", timeout=10).text  # noqa: E731
        assert "pdgate_pool_desired_engines" not in metrics()  # no answer yet
        with httpx.Client(base_url=c.url, timeout=30) as client:
            for i in range(24):
                prompt = LONG if i % 3 == 0 else f"hello {i}"
                r = client.post("/v1/completions", json={"model": c.model, "prompt": prompt, "max_tokens": 8})
                assert r.status_code == 200, r.text
        wait_for(lambda: sample(metrics(), "pdgate_planner_window_requests") == 24, timeout=15)
        text = metrics()
        prefill = sample(text, "pdgate_pool_desired_engines", pool="prefill")
        decode = sample(text, "pdgate_pool_desired_engines", pool="decode")
        assert prefill > 0 and decode > 0  # long prompts went P/D: both pools are asked for
        assert sample(text, "pdgate_planner_unmet") == 0
        # 24 requests in well under a minute on a 70B profile: a small fraction of an engine each
        assert prefill < 1 and decode < 1
    finally:
        group.stop_all()
