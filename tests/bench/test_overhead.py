"""bench/overhead.py's comparison with another checkout (``--baseline``): both sides must run the
same number of worker processes, or the figures compare two processes with one."""

from __future__ import annotations

from pathlib import Path

from bench.overhead import _has_workers


def test_this_checkout_and_a_baseline_with_worker_processes_are_given_the_count(tmp_path: Path) -> None:
    assert _has_workers(None)
    for module in ("gateway/cluster/workers.py", "gateway/workers.py"):  # today's layout, and the first one
        checkout = tmp_path / module.replace("/", "_")
        (checkout / module).parent.mkdir(parents=True)
        (checkout / module).write_text("")
        assert _has_workers(str(checkout))


def test_a_baseline_from_before_worker_processes_is_not(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    assert not _has_workers(str(tmp_path))
