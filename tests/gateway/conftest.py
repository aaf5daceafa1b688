"""Fixtures of the request-path tests (exchange, legs, answer relay, migration): a scripted
harness per test (tests/gateway/exchange_harness.py), closed after it, and the test tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from .exchange_harness import make


@pytest.fixture
def h(tokenizer_dir):
    harness = make(tokenizer_dir)
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
