"""Fixtures shared by every suite: a tokenizer built locally (no model hub on CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_model.tinymodel import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
