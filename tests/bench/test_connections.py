"""bench/connections.py at a tiny scale: both servers answer every request on new and on kept
connections, and the CPU each spent is read from /proc."""

from __future__ import annotations

import json

from bench.connections import main


def test_both_servers_are_measured_on_new_and_kept_connections(tmp_path, capsys):
    out = tmp_path / "connections.json"
    assert main(["--requests", "40", "--rounds", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"uvicorn/new", "uvicorn/kept", "guard/new", "guard/kept"}
    assert all(v >= 0 for v in report["median"].values())
    assert "| guard |" in capsys.readouterr().out
