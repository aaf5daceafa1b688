"""bench/decision_inputs.py: the texts the decision benchmark times are what it says they are."""

from __future__ import annotations

import random
import unicodedata

from bench.decision_inputs import Texts, conversation, japanese, next_turn


def _cjk_share(text: str) -> float:
    cjk = sum(1 for ch in text if "CJK" in unicodedata.name(ch, "") or "HIRAGANA" in unicodedata.name(ch, ""))
    return cjk / max(1, len(text))


def test_japanese_is_japanese_prose_of_the_asked_length() -> None:
    text = japanese(random.Random(1), 2000)
    assert len(text) == 2000
    assert _cjk_share(text) > 0.6
    assert japanese(random.Random(1), 2000) == text  # seeded: runs compare like with like


def test_japanese_mixed_documents_mix_scripts_and_english_ones_do_not() -> None:
    mixed = Texts(random.Random(2), japanese=True).text(20_000)
    english = Texts(random.Random(2)).text(20_000)
    assert len(mixed) == len(english) == 20_000
    assert 0.15 < _cjk_share(mixed) < 0.9  # Japanese with code and English between
    assert _cjk_share(english) < 0.01


def test_a_conversation_grows_by_one_turn() -> None:
    texts = Texts(random.Random(3))
    messages = conversation(texts, 10_000)
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
    assert sum(len(m["content"]) for m in messages) >= 10_000
    more = next_turn(texts, messages)
    assert more[: len(messages)] == messages
    assert [m["role"] for m in more[len(messages) :]] == ["assistant", "user"]
