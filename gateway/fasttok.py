"""A faster encoder for byte-level BPE tokenizers: tiktoken's, used only where it provably returns the
ids of the Hugging Face tokenizer (which vLLM uses), and only on text between added tokens.

Why the ids are the same. Both split the text with the same regex (a known pattern, checked to
cover every character, so the Split's gaps are empty) and encode each piece's UTF-8 bytes:

* HF BPE starts from one symbol per byte and repeatedly merges the adjacent pair with the lowest
  merge rank (leftmost on ties), pairs restricted to the merge list; with ``ignore_merges`` a piece
  that is itself a token is returned whole. tiktoken starts from the bytes too, merges the adjacent
  pair whose concatenation has the lowest id (leftmost on ties; both of its algorithms), any pair
  whose concatenation is a token, and returns a piece that is a token whole.
* If every token t merges to itself from its bytes under HF's rules ("self-consistency"), two parts
  c, d adjacent at any moment of HF's run on any piece with c+d = t a token form a merge: the run
  restricted to t's span performs exactly HF's run on t alone up to that moment (no part crosses the
  span's edges, and within it the same min-(rank, position) choice is made), and from [c, d] that
  run could only end at [t] if (c, d) is a merge. So the candidate pairs of both are the same.
* With each token produced by at most one merge and token ids strictly increasing along the merge
  list, "lowest merge rank" and "lowest id of the result" pick the same pair, so every step is the
  same, and both stop together. Self-consistency also makes a piece that is a token encode whole
  under HF with or without ``ignore_merges``.

Tokens containing an added token's text are left out: the segments never contain one. The regex
engines (onig in tokenizers, fancy-regex in tiktoken) are checked to agree on every character class
the pattern uses for code points below ``_CHECKED_LIMIT``; text with other code points goes to HF.
A self-check on a built-in corpus must agree too. Anything unproven: no fast path (``reason``).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

# Pre-tokenizer regexes tiktoken's engine runs with the same meaning: Llama 3's (a Split before a
# ByteLevel without regex) and GPT-2's (ByteLevel's own, tokenizers' byte_level.rs), with the
# letters their case-insensitive part matches.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_KNOWN_PATTERNS = {_LLAMA3: "sdmtlvre", _GPT2: ""}
# Code points whose classes are compared between the two regex engines at load (Latin, Greek,
# Cyrillic, Hebrew, Arabic, Indic, ..., general punctuation, symbols); text beyond goes to HF.
_CHECKED_LIMIT = 0x3000
_BEYOND = re.compile(f"[^\\x00-\\u{_CHECKED_LIMIT - 1:04x}]")
# fancy-regex gives up (a panic in tiktoken) when its backtracking stack passes 1M entries, about one
# per character of a whitespace run: longer text goes to HF.
_MAX_CHARS = 500_000

_CORPUS = (
    "Hello, world! It's a test: don't, won't, they'll, I'm, we've, she'd, THEY'RE, O'Neil's.",
    "def f(x):\n    return x**2 + 1  # comment\n\n\n\tif a != b:\r\n        pass\n",
    "Numbers 0 1 12 123 1234 12345 3.14159 1e-10 0x1F -42 1,000,000 2024-01-01T00:00:00Z",
    "   leading and trailing   \n\n  \t \u00a0 \u2003 spaces\u2028line\u2029para\x0bvt\x0cff\x85nel ",
    "Ünïcödé àéîõü ßẞ ſ Straße Ελληνικά Кириллица עברית العربية हिन्दी ไทย ქართული Ǆǅǆ ﬁ",  # noqa: RUF001
    "“quotes” ‘single’ — dash – … • → ≠ ≤ ∑ ∞ € £ ¥ © ® ™ °C ½ ² ³ ⅷ ① ' 's 'S 'ſ",  # noqa: RUF001
    "a\nb\r\nc\rd\n\n\ne  \n  f\t\t\ng''''s'''t ''' '' ?!?!...;;;:::(())[[]]{{}}<<>>",
    "中文 日本語 한국어 🙂👍🏽 mixed with ASCII",
    "x" * 300 + " " + "=" * 257 + " " + "ab" * 200 + "\n" * 40 + " " * 70 + "9" * 31,
)


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode), character to byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class FastEncoder:
    """tiktoken's ``encode_ordinary`` for text without added tokens; thread-safe (tiktoken's
    encoder is immutable and releases the GIL)."""

    def __init__(self, encoding: Any) -> None:
        self._encode = encoding.encode_ordinary

    def encode(self, text: str) -> list[int] | None:
        """The HF ids of ``text`` (which holds no added token), or None when it has code points
        the regex engines were not compared on, or too long for tiktoken's regex engine (the caller
        then encodes with HF)."""
        if len(text) > _MAX_CHARS or (not text.isascii() and _BEYOND.search(text)):
            return None
        try:
            return self._encode(text)
        except BaseException as err:  # a Rust panic surfaces as pyo3's PanicException, a BaseException
            if type(err).__name__ != "PanicException":
                raise
            log.debug("tiktoken failed (%s); encoding with HF", err)
            return None


def load(spec: dict[str, Any], serialized: str) -> tuple[FastEncoder | None, str]:
    """A fast encoder for this tokenizer (its JSON, parsed and as text), or None and why not."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    pattern, why = _pattern(spec)
    if pattern is None:
        return None, why
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model {model.get('type')!r}"
    if model.get("dropout"):
        return None, "BPE dropout"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "continuing_subword_prefix/end_of_word_suffix set"
    if model.get("byte_fallback"):
        return None, "byte_fallback"
    if spec.get("normalizer") is not None:
        return None, "a normalizer"
    added = spec.get("added_tokens") or []
    if any(t.get("normalized") for t in added):
        return None, "normalized added tokens (matched inside the segments)"
    ranks, why = _ranks(model, [t["content"] for t in added])
    if ranks is None:
        return None, why
    why = _self_consistent(serialized, ranks)
    if why:
        return None, why
    why = _classes_agree(pattern, _KNOWN_PATTERNS[pattern], tiktoken)
    if why:
        return None, why
    encoder = FastEncoder(tiktoken.Encoding("pdgate-fast", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}))
    why = _self_check(serialized, encoder, [t["content"] for t in added])
    if why:
        return None, why
    return encoder, "enabled"


def _pattern(spec: dict[str, Any]) -> tuple[str | None, str]:
    """The pre-tokenizer's regex, when it is a known one applied the way tiktoken applies it."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None, "ByteLevel pre-tokenizer with add_prefix_space or without its regex"
        return _GPT2, ""
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None, "pre-tokenizer is not Split + ByteLevel or ByteLevel"
    split, level = steps
    if level.get("type") != "ByteLevel" or level.get("use_regex", True) or level.get("add_prefix_space"):
        return None, "second pre-tokenizer is not ByteLevel without regex and prefix space"
    regex = (split.get("pattern") or {}).get("Regex")
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None, "first pre-tokenizer is not an isolating Split"
    if regex not in _KNOWN_PATTERNS:
        return None, "unknown pre-tokenizer regex"
    return regex, ""


def _ranks(model: dict[str, Any], added: list[str]) -> tuple[dict[bytes, int] | None, str]:
    """tiktoken's ranks (token bytes -> id) when the merge list is ordered as tiktoken merges."""
    decoder = _byte_decoder()
    vocab: dict[str, int] = model.get("vocab") or {}
    if any(ch not in vocab for ch in decoder):
        return None, "a byte is missing from the vocabulary"
    last = -1
    produced: set[str] = set()
    for merge in model.get("merges") or ():
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = left + right
        if token in produced:
            return None, f"two merges produce {token!r}"
        produced.add(token)
        tid = vocab.get(token)
        if tid is None or tid <= last:
            return None, f"token ids do not increase along the merge list (at {token!r})"
        last = tid
    contents = [c.encode() for c in added if c]
    inside = re.compile(b"|".join(map(re.escape, contents))) if contents else None
    ranks: dict[bytes, int] = {}
    for token, tid in vocab.items():
        if not all(ch in decoder for ch in token):
            continue  # not made of bytes: no text produces it
        raw = bytes(decoder[ch] for ch in token)
        if inside is not None and inside.search(raw):
            continue  # holds an added token's text: never inside a segment
        if raw in ranks:
            return None, "two tokens with the same bytes"
        ranks[raw] = tid
    return ranks, ""


def _self_consistent(serialized: str, ranks: dict[bytes, int]) -> str:
    """Every token must merge to itself from its bytes under HF's merges (``ignore_merges`` off)."""
    from tokenizers import Tokenizer

    spec = json.loads(serialized)
    spec["model"]["ignore_merges"] = False
    model = Tokenizer.from_str(json.dumps(spec)).model
    encoder = {b: ch for ch, b in _byte_decoder().items()}
    for raw, tid in ranks.items():
        if len(raw) > 1:
            got = model.tokenize("".join(encoder[b] for b in raw))
            if len(got) != 1 or got[0].id != tid:
                return f"token {tid} does not merge to itself"
    return ""


def _classes_agree(pattern: str, letters: str, tiktoken: Any) -> str:
    """Both regex engines must put the same code points in each class the pattern uses."""
    from tokenizers import Regex, pre_tokenizers

    text = "".join(map(chr, range(_CHECKED_LIMIT)))
    singles = {bytes([b]): b for b in range(256)}
    for cls in (r"\p{L}", r"\p{N}", r"\s", *(f"(?i:{c})" for c in letters)):
        kept = pre_tokenizers.Split(Regex(cls), behavior="removed").pre_tokenize_str(text)
        onig = set(text) - {ch for piece, _ in kept for ch in piece}
        enc = tiktoken.Encoding("pdgate-class", pat_str=cls, mergeable_ranks=singles, special_tokens={})
        fancy = set(bytes(enc.encode_ordinary(text)).decode())
        if onig != fancy:
            return f"regex engines disagree on {cls} for {sorted(onig ^ fancy)[:5]!r}"
    return ""


def _self_check(serialized: str, encoder: FastEncoder, added: list[str]) -> str:
    """Defense in depth: the built-in corpus must encode the same, on a private HF copy."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(serialized)
    texts = [*_CORPUS, "".join(_CORPUS), *(t[i:] for t in _CORPUS for i in (1, 2, 3))]
    for text in texts:
        if any(a and a in text for a in added):
            continue
        got = encoder.encode(text)
        if got is not None and got != hf.encode(text, add_special_tokens=False).ids:
            return f"self-check failed on {text[:40]!r}"
    return ""
