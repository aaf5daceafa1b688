"""``pdgate sim`` and ``pdgate plan`` refuse a bad flag, file or tokenizer in one line, never with a
traceback (issue 28: an invalid YAML profile or workload, a tokenizer folder that does not exist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine_model import profile, workload
from engine_model.plan_cli import main as plan_main
from sim.cli import main as sim_main

BROKEN_YAML = "engine: {max_model_len: [1, 2\n"


@pytest.fixture(autouse=True)
def never_serve(monkeypatch) -> None:
    """A command that should have refused its input fails the test instead of serving forever."""
    import uvicorn

    def serve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the simulator started serving")

    monkeypatch.setattr(uvicorn, "run", serve)


def one_line(err: str) -> str:
    """The error's only line (there is one, and no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_cli(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return one_line(capsys.readouterr().err)


def test_a_missing_tokenizer_folder_is_one_line_from_the_command(tmp_path: Path) -> None:
    """Through ``pdgate`` itself, as a user types it."""
    r = subprocess.run([sys.executable, "-m", "gateway", "sim", "--tokenizer", str(tmp_path / "none"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert one_line(r.stderr) == f"pdgate sim: error: --tokenizer {tmp_path / 'none'}: no such folder"


def test_a_tokenizer_that_cannot_load_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an empty folder: nothing to fetch either way
    line = run_cli(sim_main, ["--tokenizer", str(tmp_path), "--port", "0"], capsys)
    assert line.startswith(f"pdgate sim: error: --tokenizer {tmp_path}: cannot load (")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BROKEN_YAML, "line 2, column 1: YAML syntax error: expected ',' or ']', but got '<stream end>'"),
        ("engine: {max_model_len: big}\n", "engine.max_model_len must be an integer, got 'big'"),
        ("engine: {step_base_time: [1]}\n", "engine.step_base_time must be a number, got [1]"),
        ("engine: {enable_prefix_caching: 1}\n", "engine.enable_prefix_caching must be true or false, got 1"),
        ("- a list\n", "needs an 'engine' mapping"),
    ],
)
def test_a_bad_profile_is_one_line(tmp_path: Path, capsys, text: str, message: str) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(text)
    assert message in run_cli(sim_main, ["--profile", str(f)], capsys)
    assert message in run_cli(plan_main, ["--profile", str(f)], capsys)
    with pytest.raises(ValueError, match="profile"):
        profile.load(str(f))


def test_a_flag_argparse_refuses_is_one_line_without_the_usage(capsys) -> None:
    assert run_cli(sim_main, ["--profile"], capsys) == (
        "pdgate sim: error: argument --profile: expected one argument (`pdgate sim --help` lists the flags)"
    )
    assert "error: argument --rate" in run_cli(plan_main, ["--rate", "x"], capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("classes: [\n", "line 2, column 1: YAML syntax error"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: 1, itl_p90_s: 1, share: [1]}]",
         "classes[0].share must be a number, got [1]"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: fast, itl_p90_s: 1}]",
         "classes[0].ttft_s must be a number, got 'fast'"),
        ("classes: [{prompt: [1, 2], output: [1, 1], ttft_s: 1, itl_p90_s: 1, prefix_groups: 1.5}]",
         "classes[0].prefix_groups must be an integer, got 1.5"),
    ],
)  # fmt: skip
def test_a_bad_workload_is_one_line_naming_the_file(tmp_path: Path, capsys, text: str, message: str) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(text)
    line = run_cli(plan_main, ["--workload", str(f)], capsys)
    assert line.startswith(f"pdgate plan: error: workload {f}: ") and message in line
    with pytest.raises(ValueError, match="workload"):
        workload.load(str(f))


def test_a_missing_trace_is_one_line(tmp_path: Path, capsys) -> None:
    line = run_cli(plan_main, ["--trace", str(tmp_path / "none.jsonl")], capsys)
    assert line == f"pdgate plan: error: {tmp_path / 'none.jsonl'}: No such file or directory"
