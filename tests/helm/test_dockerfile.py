"""The gateway image's Dockerfile: linted with hadolint (fetched from PyPI with the chart's tools),
and its install step kept the same as the README's install command (without the dev extras)."""

from __future__ import annotations

import re
import shlex
import subprocess

from .conftest import ROOT, Tools


def test_hadolint_finds_nothing(tools: Tools):
    out = subprocess.run([str(tools.hadolint), "--no-color", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == ""


def _pip_install_args(command: str) -> list[str]:
    """The arguments of the first `pip install` in a shell command line."""
    for part in re.split(r"&&|;", command):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            return words[2:]
    raise AssertionError(f"no pip install in {command!r}")


def _normalized(args: list[str]) -> list[str]:
    """`-e '.[dev]'` is `.` for an image: no editable install, no dev extras."""
    return [re.sub(r"\[dev\]$", "", a) for a in args if a not in ("-e", "--editable")]


def test_install_step_matches_the_readme():
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(r"```bash\n(python3 -m venv[^\n]*)\n```", readme)[:1]
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = [line.removeprefix("RUN ").strip() for line in dockerfile.splitlines() if line.startswith("RUN ")]
    installs = [r for r in runs if "pip install" in r]
    assert len(installs) == 1, installs
    assert _normalized(_pip_install_args(command)) == _pip_install_args(installs[0]) == ["."]
    # the image runs the gateway as a non-root user on the config path the chart mounts
    assert re.search(r"^USER 10001$", dockerfile, re.M)
    assert 'CMD ["serve", "--config", "/etc/pdgate/config.yaml"]' in dockerfile
