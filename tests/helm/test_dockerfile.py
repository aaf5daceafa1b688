"""The images' Dockerfiles, linted with hadolint (fetched from PyPI with the chart's tools): the
gateway's, whose install step stays the same as the README's install command (without the dev
extras), and the EFA engine image's (deploy/engine-image), which must keep what makes NIXL's
LIBFABRIC backend work and its build-time check."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from .conftest import ROOT, Tools

ENGINE_DOCKERFILE = ROOT / "deploy" / "engine-image" / "Dockerfile"


@pytest.mark.parametrize("dockerfile", [ROOT / "Dockerfile", ENGINE_DOCKERFILE], ids=["gateway", "engine"])
def test_hadolint_finds_nothing(tools: Tools, dockerfile: Path):
    out = subprocess.run(
        [str(tools.hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == ""


def test_engine_image_keeps_the_efa_essentials():
    text = ENGINE_DOCKERFILE.read_text()
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0" in text
    assert re.search(r"ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+\n", text)
    assert re.search(r"ARG NIXL_VERSION=\d+\.\d+\.\d+\n", text)
    # user space only, as AWS documents for containers
    assert "./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify" in text
    for env in ("LD_LIBRARY_PATH=/opt/amazon/efa/lib", "FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1"):
        assert env in text, env
    # the build fails when NIXL's LIBFABRIC plugin has an unresolved library
    assert "libplugin_LIBFABRIC.so" in text and "ldd" in text and "not found" in text
    # the preflight lands where the chart mounts it
    assert "COPY helm/pdgate/files/preflight.py /opt/pdgate/preflight/preflight.py" in text


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
