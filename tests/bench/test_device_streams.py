"""scripts/device-streams.sh, the side-by-side run prepared for a lent many-core machine, at a
tiny scale here: each gateway is pinned to cores of its own, the backend and load to the others,
and what it measured lands in $OUT. A session lent a machine for minutes must not spend them
debugging the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the gateway and one for the load")
def test_the_device_run_pins_each_gateway_apart_from_the_load(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PY": sys.executable,
        "WHEELS": str(tmp_path / "none"),  # what this checkout has is already installed here
        "STREAMS": "20",
        "TOKENS": "5",
        "RAMP_S": "0.5",
        "GATEWAY_CORES": "1",
        "OVERHEAD_REQUESTS": "0",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin",  # no vllm-router
    }
    done = subprocess.run(
        ["bash", "scripts/device-streams.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "streams-g1.json").read_text())
    rows = {r["target"]: r for r in report["results"]}
    assert set(rows) == {"backend", "pdgate-w1", "pdgate-w1-nomig"}
    n = os.cpu_count() or 2
    assert report["cores"] == {"gateways": "0-0", "backend_and_load": f"{n // 2}-{n - 1}"}
    assert rows["pdgate-w1"]["cores"] == "0" and rows["pdgate-w1-nomig"]["cores"] == "0"
    assert all(r["errors"] == 0 and r["streams"] == 20 for r in rows.values())
    assert rows["pdgate-w1"]["router_cpu_us_per_chunk"] > 0
    assert "Python" in (out / "machine.txt").read_text()
