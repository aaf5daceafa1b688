"""bench.goodput's arguments (how it splits its engines between the P/D pools) and what a run does
with its logs, its processes replaced."""

from __future__ import annotations

import pytest

from bench import goodput, goodput_cluster


def test_engines_split_in_half_by_default() -> None:
    assert goodput.parse_args(["--engines", "4"]).prefill_engines == 2


def test_an_uneven_split_is_given_explicitly() -> None:
    args = goodput.parse_args(["--engines", "3", "--prefill-engines", "1"])
    cluster = goodput_cluster.Cluster(None, ["a", "b", "c"], 0.5, args.prefill_engines)  # type: ignore[arg-type]
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
