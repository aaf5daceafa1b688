"""How bench.goodput splits its engines between the P/D pools."""

from __future__ import annotations

import pytest

from bench import goodput


def test_engines_split_in_half_by_default() -> None:
    assert goodput.parse_args(["--engines", "4"]).prefill_engines == 2


def test_an_uneven_split_is_given_explicitly() -> None:
    args = goodput.parse_args(["--engines", "3", "--prefill-engines", "1"])
    cluster = goodput.Cluster(None, ["a", "b", "c"], 0.5, args.prefill_engines)  # type: ignore[arg-type]
    assert (cluster.prefill, cluster.decode) == (["a"], ["b", "c"])


@pytest.mark.parametrize(
    "argv",
    [["--engines", "3"], ["--engines", "3", "--prefill-engines", "3"], ["--engines", "2", "--prefill-engines", "0"]],
    ids=["odd-without-split", "no-decode-engine", "no-prefill-engine"],
)
def test_a_split_that_leaves_a_pool_empty_is_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        goodput.parse_args(argv)
    assert "engines" in capsys.readouterr().err


def test_tuned_colocated_engines_and_the_cost_models_link() -> None:
    """colocated-2k routes to engines of its own (2048-token chunks); the cost model is told the
    profile's link with its per-block cost folded in, at the chosen end of the profile's range."""
    cluster = goodput.Cluster(None, ["a", "b"], 0.5, 1, small_chunk=["s1", "s2"])  # type: ignore[arg-type]
    cfg = goodput.pdgate_config("colocated-2k", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000)  # type: ignore[arg-type]
    assert cfg["pools"]["decode"]["endpoints"] == ["s1", "s2"] and cfg["pools"]["prefill"]["endpoints"] == []
    mid = goodput.pdgate_config("pd-cost-model", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000)  # type: ignore[arg-type]
    high = goodput.pdgate_config("pd-cost-model", cluster, "tok", "llama-3.3-70b-tp8-h100", 9000, "high")  # type: ignore[arg-type]
    link_mid, link_high = (c["routing"]["decider"]["kv_bandwidth_gbps"] for c in (mid, high))
    # 640 Gbps and 0.32 ms per 16-token block: ~110 Gbps of KV; the costly end is slower still
    assert 95 < link_mid * 0.5 < 125 and link_high < link_mid
    assert goodput.parse_args(["--profile-end", "low"]).profile_end == "low"
