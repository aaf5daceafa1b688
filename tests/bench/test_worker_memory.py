"""bench/worker_memory.py's instruments: what it links onto the gateway's path, and what it reads
of a process's memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.worker_memory import _children, memory, torch_path


def test_torch_path_links_only_pytorch_and_its_start_up_packages(tmp_path) -> None:
    site = tmp_path / "site"
    for name in ("torch", "torch-2.13.0.dist-info", "sympy", "numpy", "transformers", "filelock-3.0.dist-info"):
        (site / name).mkdir(parents=True)
    linked = torch_path(site, tmp_path / "links")
    names = sorted(os.listdir(linked))
    assert names == ["filelock-3.0.dist-info", "sympy", "torch", "torch-2.13.0.dist-info"]
    assert all(os.path.islink(os.path.join(linked, n)) for n in names)  # the gateway's own packages win


def test_memory_reads_this_process_and_finds_its_children() -> None:
    here = memory(os.getpid())
    assert here["rss_mb"] > 5 and 0 < here["pss_mb"] <= here["peak_rss_mb"] + 1
    assert here["torch_mapped"] is False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in _children(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in _children(os.getpid())
    finally:
        child.kill()
        child.wait()
