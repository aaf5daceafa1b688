"""gateway/tokenization/regex_classes.py: where onig and fancy-regex class characters alike."""

from __future__ import annotations

import re

from gateway.tokenization import regex_classes


def test_code_points() -> None:
    text = regex_classes.code_points()
    assert len(text) == 0x110000 - 0x800
    assert text[0] == "\x00" and text[-1] == "\U0010ffff"
    assert text[0xD7FF:0xD801] == "\ud7ff\ue000"
    assert list(map(ord, text)) == [*range(0xD800), *range(0xE000, 0x110000)]


def test_class_differences_finds_where_the_engines_part() -> None:
    text = regex_classes.code_points()[:0x10000]
    differ, members = regex_classes.class_differences(r"\p{L}", r"[\p{L}--\p{Han}]", text)
    assert "日" in differ and "本" in differ and "あ" not in differ and "a" not in differ
    assert {ch for ch in differ if ch < "\u2e80"} == set()
    assert "日" in members and "a" in members  # matched by either
    assert regex_classes.class_differences(r"\p{L}", r"\p{L}", text)[0] == set()
    body = regex_classes.class_body({"a", "b", "c", "x", "-", "]", "^", "\\"})
    assert body == "\\-\\\\-\\^a-cx"  # ranges of consecutive characters, escaped
    assert {chr(c) for c in range(128) if re.fullmatch(f"[{body}]", chr(c))} == set("abcx-]^\\")


def test_engine_differences_are_none_for_both_known_patterns() -> None:
    assert regex_classes.engine_differences("sdmtlvre") == ("", "")  # Llama 3's contractions
    assert regex_classes.engine_differences("") == ("", "")  # GPT-2's (no case-insensitive part)
