"""Fixtures of the chat tests (test_chat*.py): the test tokenizer loaded once per module, as
transformers' tokenizer and as the LeanTokenizer (every test runs on both), and a ModelTokenizer
over it with a 64-token context."""

from __future__ import annotations

import pytest

from gateway.config import ModelConfig
from gateway.tokenization import bundle, reference
from gateway.tokenization.lean import LeanTokenizer
from tests.engine_model.chat_helpers import make


@pytest.fixture(scope="module")
def reference_hf(tokenizer_dir):
    """transformers' tokenizer: the reference the gateway's rendering is compared with."""
    return reference.load(ModelConfig(name="tiny", tokenizer=str(tokenizer_dir), max_model_len=64)).hf


@pytest.fixture(scope="module", params=["transformers", "lean"])
def hf(request, reference_hf):
    """Each chat test runs on both implementations of the tokenizer interface ModelTokenizer uses:
    transformers' own and the LeanTokenizer workers use (the conformance suite of lean.py)."""
    if request.param == "transformers":
        return reference_hf
    return LeanTokenizer(bundle.of(reference.Reference(reference_hf, None, None)))


@pytest.fixture(scope="module")
def tok(hf):
    return make(hf, max_model_len=64)
