"""Lint and format (ruff) and types (mypy --strict on gateway/, policies/, engine_model/ and sim/;
config in pyproject.toml) are part of the test run, so a fresh clone's ``pytest`` checks what
review would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean() -> None:
    done = _run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_applied() -> None:
    done = _run("ruff", "format", "--check", ".")
    assert done.returncode == 0, "run `ruff format .`:\n" + done.stdout + done.stderr


def test_mypy_is_clean() -> None:
    done = _run("mypy")  # its cache (.mypy_cache) makes a re-run take seconds
    assert done.returncode == 0, done.stdout + done.stderr
