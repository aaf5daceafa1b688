r"""Whether two regex engines put every character in the same classes, over all of Unicode.

The Rust tokenizer splits text with onig; tiktoken with fancy-regex. The byte-level BPE
pre-tokenizer patterns fasttok accepts are made only of character classes (``\p{L}``, ``\p{N}``,
``\s`` and, under ``(?i:...)``, the contractions' letters) and operators both engines read alike,
so the two split alike exactly where they class every character alike. ``engine_differences``
compares each class over every code point (~0.5 s of CPU, once per process and pattern) and
returns the characters they class differently, for fasttok to send text holding one to the Rust
tokenizer.
"""

from __future__ import annotations

import array
import functools
import logging
import re
import sys

import tiktoken

log = logging.getLogger(__name__)


def code_points() -> str:
    """Every Unicode scalar value once, in order (all code points but the surrogates)."""
    points = array.array("I", range(0xD800))
    points.extend(range(0xE000, 0x110000))
    if points.itemsize != 4:  # not on the platforms tiktoken ships for
        return "".join(map(chr, points))
    return points.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")


_SINGLES = {bytes([b]): b for b in range(256)}


def class_differences(onig: str, fancy: str, text: str) -> tuple[set[str], str]:
    """For a pattern that matches one character at a time, run by onig (as ``onig``, the way the
    tokenizer's Split and Replace run a Regex) and by fancy-regex (as ``fancy``, the way tiktoken
    runs its pattern): the characters of ``text`` (each there once) they put on different sides,
    and those either matches, in order.

    onig's side is ``rest``, the text with its matches removed; fancy-regex's is ``matched``, its
    matches' bytes (one token per byte). When fancy-regex finds nothing in ``rest`` and the two
    add up to the text, its matches are exactly the characters onig removed (disjoint from the
    rest and as many), so one pass of each engine decides; else the sets say where they part."""
    from tokenizers import Regex, normalizers

    rest = normalizers.Replace(Regex(onig), "").normalize_str(text)
    encoding = tiktoken.Encoding("pdgate-class", pat_str=fancy, mergeable_ranks=_SINGLES, special_tokens={})
    matched = bytes(encoding.encode_ordinary(text)).decode()
    if len(rest) + len(matched) == len(text) and not encoding.encode_ordinary(rest):
        return set(), matched
    onig_matched = set(text) - set(rest)
    return onig_matched ^ set(matched), "".join(sorted(onig_matched | set(matched)))


@functools.cache
def engine_differences(contractions: str) -> tuple[str | None, str]:
    r"""The characters onig and fancy-regex put differently in a class a known pre-tokenizer
    pattern uses (``contractions``: the letters of its case-insensitive contractions), over every
    code point, as a regex class body ('' for none; text with them goes to HF); None and why
    when one is ASCII (the fast path would be pointless). Once per process and pattern
    (~0.5 s: one pass of each engine over 1.1M characters, then passes over the ~143k in a class).

    The classes: ``\p{L}``, ``\p{N}``, ``\s``, and under ``(?i:...)`` each letter of the
    case-insensitive contractions and the apostrophe. A character is in an alternation of classes
    in either engine exactly when it is in one of them, so one pass over everything with their
    alternation finds every character in any class (and those where the engines part already);
    each class is then compared on those characters only (the case-insensitive ones, again, on
    the few that match their alternation)."""
    letters = [f"(?i:{ch})" for ch in ("'", *contractions)] if contractions else []
    folded = "|".join(letters)
    groups = [r"\p{L}", r"\p{N}", r"\s", *([folded] if letters else [])]
    union = "|".join(groups)
    differ, members = class_differences(union, union, code_points())
    for cls in groups:
        found, matched = class_differences(cls, cls, members)
        differ |= found
        if cls == folded:
            for letter in letters:
                differ |= class_differences(letter, letter, matched)[0]
    if any(ch.isascii() for ch in differ):
        return None, f"regex engines disagree on ASCII characters: {sorted(ch for ch in differ if ch.isascii())!r}"
    if differ:
        log.info("regex engines class %d code points differently; text with them is encoded by HF", len(differ))
    return class_body(differ), ""


def class_body(chars: set[str]) -> str:
    """A regex character class body matching exactly ``chars`` (ranges of consecutive ones)."""
    points = sorted(map(ord, chars))
    out: list[str] = []
    i = 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        first, last = re.escape(chr(points[i])), re.escape(chr(points[j]))
        out.append(first if i == j else f"{first}-{last}")
        i = j + 1
    return "".join(out)
