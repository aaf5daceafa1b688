"""gateway/tokenization/frameworks.py: a worker loads its tokenizer without importing PyTorch (or
TensorFlow, JAX) even where they are installed; a tokenizer that needs one says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tokenization import frameworks
from tests.frameworks_stub import install

LOAD = """
import json, sys
from gateway.config import ModelConfig
from gateway.tokenization.tokenizer import ModelTokenizer
tok = ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=sys.argv[1], max_model_len=4096))
text = tok.hf.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
print(json.dumps({"ids": tok.backend.encode(text).ids, "frameworks": __import__(
    "gateway.tokenization.frameworks", fromlist=["loaded"]).loaded(), "transformers": "transformers" in sys.modules}))
"""


def _run(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def stubs(tmp_path: Path) -> tuple[dict[str, str], Path]:
    log = tmp_path / "imported.log"
    return install(tmp_path / "site", log), log


def test_the_stand_in_torch_is_what_transformers_would_import(stubs, tokenizer_dir) -> None:
    # Without the gateway's guard, importing AutoTokenizer reaches for the installed torch: the
    # stand-in is a faithful trap (this is what cost ~840 MB per worker).
    env, log = stubs
    done = _run("from transformers import AutoTokenizer", env)
    assert done.returncode != 0
    assert "torch imported" in log.read_text()


def test_a_tokenizer_loads_without_importing_any_framework(stubs, tokenizer_dir) -> None:
    env, log = stubs
    done = _run(LOAD, env, str(tokenizer_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ids"] and out["frameworks"] == []
    assert out["transformers"] is False  # loaded in a child process, handed over as a bundle (lean.py)
    assert not log.exists(), log.read_text()
    # the same ids as where no framework is installed at all
    plain = _run(LOAD, {}, str(tokenizer_dir))
    assert json.loads(plain.stdout.strip().splitlines()[-1])["ids"] == out["ids"]


def test_a_tokenizer_whose_code_imports_torch_fails_with_one_line_naming_it(stubs, tmp_path, tokenizer_dir) -> None:
    env, log = stubs
    folder = tmp_path / "custom"
    folder.mkdir()
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "custom_tok.py").write_text(
        "import torch\nfrom transformers import PreTrainedTokenizerFast\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]}
    config["tokenizer_class"] = "CustomTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = folder / "gateway.yaml"
    cfg.write_text(
        json.dumps(
            {
                "auth": {"disabled": True},
                "admin": {"disabled": True},
                "models": [
                    {"name": "custom", "tokenizer": str(folder), "trust_remote_code": True, "max_model_len": 4096}
                ],
                "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": ["http://127.0.0.1:9"]}},
            }
        )
    )
    done = _run(
        "import sys; from gateway.cli import main; raise SystemExit(main(['check-config', sys.argv[1]]))", env, str(cfg)
    )
    err = done.stderr.strip()
    assert done.returncode != 0
    assert "Traceback" not in err, err
    assert "imports torch" in err and "models[0].tokenizer" in err, err
    assert not log.exists()


def test_keep_out_leaves_a_framework_already_imported_alone() -> None:
    saved = {name: sys.modules[name] for name in frameworks.FRAMEWORKS if name in sys.modules}
    sentinel = object()
    sys.modules["jax"] = sentinel  # type: ignore[assignment]
    try:
        frameworks.keep_out()
        assert sys.modules["jax"] is sentinel
        assert "jax" in frameworks.loaded()
    finally:  # this process's other tests keep their imports as they were
        for name in frameworks.FRAMEWORKS:
            if name in saved:
                sys.modules[name] = saved[name]
            else:
                sys.modules.pop(name, None)


def test_blocked_names_the_framework_only_when_the_guard_stopped_it() -> None:
    # The guard's mark, set here directly: earlier tests in this process may have imported
    # transformers, after which keep_out rightly leaves the frameworks alone.
    saved = sys.modules.get("torch", ...)
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError as err:
            wrapped = RuntimeError("loading failed")
            wrapped.__cause__ = err
            assert frameworks.blocked(wrapped) == "torch"
        else:
            raise AssertionError("a None entry in sys.modules must halt the import")
    finally:
        if saved is ...:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved  # type: ignore[assignment]
    assert frameworks.blocked(ModuleNotFoundError("no module", name="sentencepiece")) is None
    # torch missing for another reason (not installed) is not the guard's doing
    assert frameworks.blocked(ModuleNotFoundError("No module named 'torch'", name="torch")) is None
