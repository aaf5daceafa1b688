"""A tokenizer named by its hub name, where the hub cannot give it (issue 28, point 3): told in one
line and in seconds (not after a minute of the library's retries), with what to do; a copy in the
local hub cache still serves. The hub here is a stand-in on loopback, or a closed port."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from gateway.tokenization import hub
from tests.procs import free_port

README_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal.yaml"  # "Configuration" shows it


class FakeHub(BaseHTTPRequestHandler):
    """Answers HEAD /<repo>/resolve/<rev>/<file> with the status and X-Error-Code the hub sends."""

    answers = {
        "org/gated": (403, "GatedRepo"),
        "org/missing": (404, "RepoNotFound"),
        "org/no-config": (404, "EntryNotFound"),
        "org/broken": (500, None),
    }

    def do_HEAD(self) -> None:
        repo = self.path.lstrip("/").split("/resolve/")[0]
        status, code = self.answers.get(repo, (200, None))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def fake_hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py): these tests ask a hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_what_the_hub_says_is_told_apart(fake_hub, online):
    assert hub.probe("org/ok", endpoint=fake_hub) is None
    assert hub.probe("org/no-config", endpoint=fake_hub) is None  # there; transformers finds what it has
    gated = hub.probe("org/gated", endpoint=fake_hub)
    assert gated is not None and "gated" in gated.what and "HF_TOKEN" in gated.advice
    missing = hub.probe("org/missing", endpoint=fake_hub)
    assert missing is not None and "no such repository" in missing.what
    broken = hub.probe("org/broken", endpoint=fake_hub)
    assert broken is not None and "answered 500" in broken.what


def test_an_unreachable_hub_and_a_missing_folder(tmp_path, online):
    closed = f"http://127.0.0.1:{free_port()}"
    down = hub.probe("org/model", endpoint=closed)
    assert down is not None and f"the hub ({closed}) is unreachable" in down.what
    assert "HF_HUB_OFFLINE=1" in down.advice and "local folder" in down.advice
    nowhere = hub.probe(str(tmp_path / "nowhere"), endpoint=closed)  # not a hub name: no request
    assert nowhere is not None and "no such folder" in nowhere.what


def test_offline_mode_is_a_choice(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = hub.probe("org/model")
    assert offline is not None and offline.chosen and "hf download org/model" in offline.advice


def check_config(config: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``pdgate check-config`` with a hub that refuses connections, HF_HUB_OFFLINE unset and an empty
    (or given) hub cache. Before the probe it took ~50 s of retries: the timeout is the test."""
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=20,
        env={**base, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf"), **env},
    )


def test_check_config_on_the_readme_example_offline_is_one_line_with_what_to_do(tmp_path):
    done = check_config(README_EXAMPLE, tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"{README_EXAMPLE}: models[0].tokenizer: cannot load 'meta-llama/Llama-3.3-70B-Instruct'")
    assert "is unreachable" in line and "HF_HUB_OFFLINE=1" in line and "--no-tokenizers" in line


def test_a_tokenizer_in_the_hub_cache_serves_while_the_hub_is_unreachable(tmp_path, tokenizer_dir):
    """The hub cache's layout: models--org--name/{refs/main, snapshots/<commit>/<files>}, and
    .no_exist/<commit>/<file> for a file the repository does not have (this one has no config.json)."""
    repo = tmp_path / "hf" / "hub" / "models--pdgate-test--tiny"
    commit = "0" * 40
    shutil.copytree(tokenizer_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / ".no_exist" / commit).mkdir(parents=True)
    (repo / ".no_exist" / commit / "config.json").touch()
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": "m", "tokenizer": "pdgate-test/tiny", "max_model_len": 100}],
                "pools": {"decode": {"endpoints": ["http://d0:8000"]}},
            }
        )
    )
    done = check_config(config, tmp_path)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
