"""gateway/tokenization/bundle.py: transformers' load in a child process gives the same bundle as
in place, its errors come back as the same one-line errors, and its log records are replayed."""

from __future__ import annotations

import logging

import pytest

from gateway.config import ModelConfig
from gateway.tokenization import bundle, reference
from gateway.tokenization.hub import TokenizerUnavailable


def test_the_child_gives_what_transformers_gives_in_place(tokenizer_dir) -> None:
    cfg = ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)
    in_place = bundle.of(reference.load(cfg))
    child = bundle._from_child(cfg)
    assert child.model_dump(exclude={"notes"}) == in_place.model_dump(exclude={"notes"})
    assert child.chats and all(p.text or p.error for p in child.chats)  # every probe has an outcome
    assert any(p.error is None for p in child.chats)


def test_a_tokenizer_that_cannot_be_had_fails_with_the_same_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = ModelConfig(name="m", tokenizer="nowhere/no-such-model", max_model_len=64)
    with pytest.raises(TokenizerUnavailable) as in_place:
        reference.load(cfg)
    with pytest.raises(TokenizerUnavailable) as child:
        bundle._from_child(cfg)
    assert str(child.value) == str(in_place.value)


def test_a_broken_tokenizer_names_the_cause(tmp_path, tokenizer_dir) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(Exception) as child:
        bundle._from_child(ModelConfig(name="m", tokenizer=str(folder), max_model_len=64))
    assert "Traceback" not in str(child.value) and str(child.value)


def test_the_childs_log_records_are_replayed(monkeypatch, caplog, tokenizer_dir) -> None:
    import gateway.tokenization.reference as ref_mod

    cfg = ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)
    made = bundle.of(ref_mod.load(cfg))
    made.notes = [(logging.WARNING, "model tiny: from the local hub cache")]
    monkeypatch.setattr(bundle.subprocess, "run", lambda *a, **k: _Done(made.model_dump_json().encode()))
    with caplog.at_level(logging.INFO, logger="gateway.tokenization.bundle"):
        bundle._from_child(cfg)
    assert "from the local hub cache" in caplog.text


def test_a_child_that_dies_says_so_in_one_line(monkeypatch, tokenizer_dir) -> None:
    monkeypatch.setattr(bundle.subprocess, "run", lambda *a, **k: _Done(b"", b"Killed\n", -9))
    with pytest.raises(RuntimeError, match="the tokenizer's loading process failed: Killed"):
        bundle._from_child(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64))


class _Done:
    def __init__(self, stdout: bytes, stderr: bytes = b"", returncode: int = 0) -> None:
        self.stdout, self.stderr, self.returncode = stdout, stderr, returncode
