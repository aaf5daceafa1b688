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


@pytest.fixture
def no_processes(monkeypatch, tmp_path):
    """run() without engines or routers: its log folder is tmp_path/logs."""
    logs = tmp_path / "logs"
    monkeypatch.setattr(goodput, "build_tokenizer", lambda path: tmp_path / "tok")
    monkeypatch.setattr(goodput.tempfile, "mkdtemp", lambda prefix: (logs.mkdir(), str(logs))[1])
    monkeypatch.setattr(goodput, "start_engines", lambda *a, **kw: ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    monkeypatch.setattr(goodput, "start_routers", lambda *a, **kw: (logs / "router.log").write_text("started\n"))
    return logs


def test_a_run_that_succeeds_removes_its_log_folder(no_processes, capsys) -> None:
    args = goodput.parse_args(["--configs", "pd-always"])
    args.workloads = []  # nothing to replay
    assert goodput.run(args)["points"] == []
    assert not no_processes.exists() and "kept" not in capsys.readouterr().err


def test_a_run_keeps_its_logs_when_asked_or_when_it_fails(no_processes, monkeypatch, capsys) -> None:
    args = goodput.parse_args(["--configs", "pd-always", "--keep-logs"])
    args.workloads = []
    goodput.run(args)
    assert (no_processes / "router.log").exists()
    assert f"logs kept in {no_processes}" in capsys.readouterr().err
    (no_processes / "router.log").unlink()
    no_processes.rmdir()

    def fails(*a, **kw):
        raise RuntimeError("pd-always exited")

    monkeypatch.setattr(goodput, "start_routers", fails)
    args = goodput.parse_args(["--configs", "pd-always"])
    with pytest.raises(RuntimeError):
        goodput.run(args)
    assert no_processes.exists() and f"logs kept in {no_processes}" in capsys.readouterr().err
