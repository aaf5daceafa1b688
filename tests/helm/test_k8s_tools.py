"""scripts/k8s-tools.sh and the conftest around it: on a platform the fetched helm binary cannot run
on, the script says so with its own exit status (and fetches nothing), and the chart checks skip
instead of failing."""

from __future__ import annotations

import os
import subprocess

from . import conftest
from .conftest import ROOT


def _fake_uname(tmp_path, system: str, machine: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    uname = bin_dir / "uname"
    uname.write_text(f'#!/bin/sh\ncase "$1" in -s) echo {system};; -m) echo {machine};; *) echo {system};; esac\n')
    uname.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PDGATE_CACHE_DIR": str(tmp_path / "cache")}


def test_script_refuses_an_unsupported_platform_without_fetching(tmp_path):
    for system, machine in (("Linux", "aarch64"), ("Darwin", "x86_64")):
        case = tmp_path / f"{system}-{machine}"
        case.mkdir()
        env = _fake_uname(case, system, machine)
        run = subprocess.run(
            ["bash", str(ROOT / "scripts" / "k8s-tools.sh")], capture_output=True, text=True, env=env, timeout=60
        )
        assert run.returncode == conftest.UNSUPPORTED, run.stderr
        assert f"unsupported platform {system}/{machine}" in run.stderr and run.stdout == ""
        assert not (case / "cache").exists()


def test_conftest_reads_the_platform(monkeypatch):
    monkeypatch.setattr(conftest.sys, "platform", "linux")
    monkeypatch.setattr(conftest.platform, "machine", lambda: "x86_64")
    assert conftest.supported_platform()
    monkeypatch.setattr(conftest.platform, "machine", lambda: "aarch64")
    assert not conftest.supported_platform()
    monkeypatch.setattr(conftest.sys, "platform", "darwin")
    monkeypatch.setattr(conftest.platform, "machine", lambda: "x86_64")
    assert not conftest.supported_platform()
