"""bench.goodput_cluster without processes: the gateway configs of
the tuned colocated engines and of the cost model's link."""

from __future__ import annotations

from bench import goodput, goodput_cluster


def test_tuned_colocated_engines_and_the_cost_models_link() -> None:
    """colocated-2k routes to engines of its own (2048-token chunks); the cost model is told the
    profile's link with its per-block cost folded in, at the chosen end of the profile's range."""
    cluster = goodput_cluster.Cluster(None, ["a", "b"], 0.5, 1, small_chunk=["s1", "s2"])  # type: ignore[arg-type]
    cfg = goodput_cluster.pdgate_config("colocated-2k", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000)  # type: ignore[arg-type]
    assert cfg["pools"]["decode"]["endpoints"] == ["s1", "s2"] and cfg["pools"]["prefill"]["endpoints"] == []
    mid = goodput_cluster.pdgate_config("pd-cost-model", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000)  # type: ignore[arg-type]
    high = goodput_cluster.pdgate_config("pd-cost-model", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000, "high")  # type: ignore[arg-type]
    link_mid, link_high = (c["routing"]["decider"]["kv_bandwidth_gbps"] for c in (mid, high))
    # 640 Gbps and 0.32 ms per 16-token block: ~110 Gbps of KV; the costly end is slower still
    assert 95 < link_mid * 0.5 < 125 and link_high < link_mid
    assert goodput.parse_args(["--profile-end", "low"]).profile_end == "low"
