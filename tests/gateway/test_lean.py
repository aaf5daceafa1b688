"""gateway/tokenization/lean.py: the LeanTokenizer reproduces transformers' probes, notices when it
does not, and ModelTokenizer.load then tokenizes with transformers itself (and says so)."""

from __future__ import annotations

import copy
import logging

from gateway.config import ModelConfig
from gateway.tokenization import bundle, reference
from gateway.tokenization.lean import LeanTokenizer
from gateway.tokenization.tokenizer import ModelTokenizer


def _made(tokenizer_dir) -> bundle.Bundle:
    return bundle.of(reference.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)))


def test_a_faithful_bundle_has_no_differences(tokenizer_dir) -> None:
    made = _made(tokenizer_dir)
    assert LeanTokenizer(made).differs(made) is None


def test_a_template_rendered_otherwise_is_caught(tokenizer_dir) -> None:
    made = _made(tokenizer_dir)
    wrong = made.model_copy(deep=True)
    wrong.chats[0].text = (wrong.chats[0].text or "") + "x"
    assert "probe 0" in (LeanTokenizer(made).differs(wrong) or "")


def test_other_ids_are_caught(tokenizer_dir) -> None:
    made = _made(tokenizer_dir)
    wrong = made.model_copy(deep=True)
    wrong.texts[1].ids = [*wrong.texts[1].ids, 0]
    assert "other ids" in (LeanTokenizer(made).differs(wrong) or "")


def test_load_falls_back_to_transformers_when_a_probe_differs(monkeypatch, caplog, tokenizer_dir) -> None:
    made = _made(tokenizer_dir)
    wrong = made.model_copy(deep=True)
    wrong.chats[1].text = "not what lean renders"
    monkeypatch.setattr(bundle, "make", lambda cfg: wrong)
    with caplog.at_level(logging.WARNING):
        tok = ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64))
    assert not isinstance(tok.hf, LeanTokenizer)
    assert "loads transformers to tokenize it" in caplog.text


def test_load_keeps_the_lean_tokenizer_when_it_agrees(tokenizer_dir) -> None:
    tok = ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64))
    assert isinstance(tok.hf, LeanTokenizer)


def test_a_copy_renders_with_its_own_templates(tokenizer_dir) -> None:
    lean = LeanTokenizer(_made(tokenizer_dir))
    twin = copy.deepcopy(lean)
    twin.chat_template = "twin:{{ messages[0].content }}"
    msg = [{"role": "user", "content": "q"}]
    assert twin.apply_chat_template(msg, tokenize=False) == "twin:q"
    assert lean.apply_chat_template(msg, tokenize=False) != "twin:q"
