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
