"""Fixtures of the chat tests (test_chat*.py): the test tokenizer loaded once per module, and a
ModelTokenizer over it with a 64-token context."""

from __future__ import annotations

import pytest

from gateway.config import ModelConfig
from gateway.tokenization.tokenizer import ModelTokenizer
from tests.engine_model.chat_helpers import make


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return ModelTokenizer.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)).hf


@pytest.fixture(scope="module")
def tok(hf):
    return make(hf, max_model_len=64)
