r"""A faster encoder for byte-level BPE tokenizers: tiktoken's, used only where it provably returns the
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
engines (onig in tokenizers, fancy-regex in tiktoken) split alike when they put every character in
the same classes: the pattern is made only of classes (``\p{L}``, ``\p{N}``, ``\s`` and, under
``(?i:...)``, the letters of the contractions) and of operators both engines give the same
backtracking meaning. So every class is compared over every Unicode code point at load
(``regex_classes.engine_differences``, ~0.5 s of CPU once per process and pattern); text with a code point they put
differently (none with the tokenizers and tiktoken of this writing), or a lone surrogate (no UTF-8),
goes to HF. A self-check on a built-in corpus in many scripts must agree too. Anything unproven: no
fast path (``reason``).

Meta's Llama 3 ``tokenizer.json`` fails that proof (several merges make one token: its merge list
holds every split of every token), so ``load_ranks`` is a second, separately checked source:
tiktoken ranks that are the vocabulary's ids (``vocabulary_ranks``; the model's own ranks file,
``original/tokenizer.model`` in Meta's repositories, is used where present and must be exactly
them). Its checks narrow the possible differences to one case, then look for it (see
``load_ranks``); whatever is left is covered by re-encoding 1 in ``SAMPLE_EVERY`` live texts with
the Rust tokenizer (``RunTimeCheck``): a mismatch turns that fast path off and is counted
(``mismatches``).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from gateway.tokenization import regex_classes

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
# Lone surrogates: a Python str may hold them, UTF-8 cannot (the Rust tokenizer refuses the text).
_SURROGATES = "\ud800-\udfff"
# fancy-regex gives up (a panic in tiktoken) when its backtracking stack passes 1M entries, about one
# per character of a whitespace run: longer text goes to HF.
_MAX_CHARS = 500_000
# Where a model folder keeps tiktoken ranks: Meta's repositories under original/ (a tokenizer.model
# at the top is usually SentencePiece's; the format is checked).
RANKS_FILES = ("original/tokenizer.model", "tokenizer.model")
# 1 in SAMPLE_EVERY texts encoded from a ranks file is encoded again by the Rust tokenizer, on a
# background thread; at most _PENDING samples wait, more are dropped (the check's cost is bounded).
SAMPLE_EVERY = 64
_PENDING = 8
SELF_CHECK_FAILED = "self-check failed"

_CORPUS = (
    "Hello, world! It's a test: don't, won't, they'll, I'm, we've, she'd, THEY'RE, O'Neil's.",
    "def f(x):\n    return x**2 + 1  # comment\n\n\n\tif a != b:\r\n        pass\n",
    "Numbers 0 1 12 123 1234 12345 3.14159 1e-10 0x1F -42 1,000,000 2024-01-01T00:00:00Z",
    "   leading and trailing   \n\n  \t \u00a0 \u2003 spaces\u2028line\u2029para\x0bvt\x0cff\x85nel ",
    "Ünïcödé àéîõü ßẞ ſ Straße Ελληνικά Кириллица עברית العربية हिन्दी ไทย ქართული Ǆǅǆ ﬁ",  # noqa: RUF001
    "“quotes” ‘single’ — dash – … • → ≠ ≤ ∑ ∞ € £ ¥ © ® ™ °C ½ ² ³ ⅷ ① ' 's 'S 'ſ",  # noqa: RUF001
    "a\nb\r\nc\rd\n\n\ne  \n  f\t\t\ng''''s'''t ''' '' ?!?!...;;;:::(())[[]]{{}}<<>>",
    "中文 日本語 한국어 🙂👍🏽 mixed with ASCII",
    "日本語の文章は、ひらがな・カタカナ・漢字が混ざり、単語の間に空白がありません。「東京」で２０２４年に"
    "ＧＰＵを３台、ｶﾀｶﾅも。\u3000全角空白のあと…ですね？ 𠮷野家の𩸽、々〆ヶ〇、ー～〜",  # noqa: RUF001
    "我们在北京测试了这个模型：效果很好！繁體中文：這是一個測試。數字１２３和标点，；、",  # noqa: RUF001
    "한국어 문장은 띄어쓰기를 합니다. 서울에서 2024년에 테스트했어요! ㄱㄴㄷ ㅏㅑ 한글과 漢字",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1ef\U0001f1f5 1\ufe0f\u20e3 \u2764\ufe0f \U0001f44b\U0001f3ff "
    "\U0001fae0 \U0001f3f4\U000e0067\U000e0062\U000e007f \u2ff0\u6c35\u6bcf \u3297 \u337f \uff65 \U00020000",
    "def 関数(引数):  # コメント\n    return f'結果: {引数!r}'  // 注释 /* 주석 */\n\tprint(\"こんにちは、世界\")\n",
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

    def __init__(self, encoding: Any, *, sampled: bool = False, differ: str = "") -> None:
        self._encode: Callable[[str], list[int]] = encoding.encode_ordinary
        # True when the ids are checked (load_ranks) rather than proven (load): callers sample them
        # at run time and let the exact tokenizer decide near the context limit.
        self.sampled = sampled
        # Text with a character the regex engines class differently (``_engine_differences``; a
        # regex class body, usually empty) or with a lone surrogate goes to HF.
        self.differ = differ
        self._to_hf = re.compile(f"[{_SURROGATES}{differ}]")

    def hands_over(self, text: str) -> bool:
        """Whether ``encode`` leaves this text to HF: too long for tiktoken's regex engine, or a
        character the regex engines class differently, or a lone surrogate."""
        return len(text) > _MAX_CHARS or (not text.isascii() and self._to_hf.search(text) is not None)

    def encode(self, text: str) -> list[int] | None:
        """The HF ids of ``text`` (which holds no added token), or None when ``hands_over`` (the
        caller then encodes with HF)."""
        if self.hands_over(text):
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
    pattern, why = _byte_level_bpe(spec)
    if pattern is None:
        return None, why
    model = spec["model"]
    added = spec.get("added_tokens") or []
    ranks, why = _ranks(model, [t["content"] for t in added])
    if ranks is None:
        return None, why
    why = _self_consistent(serialized, ranks)
    if why:
        return None, why
    differ, why = _engine_differences(pattern)
    if differ is None:
        return None, why
    encoding = tiktoken.Encoding("pdgate-fast", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    encoder = FastEncoder(encoding, differ=differ)
    why = _self_check(serialized, encoder, [t["content"] for t in added])
    if why:
        return None, why
    return encoder, "enabled" + _differ_note(differ)


def _byte_level_bpe(spec: dict[str, Any]) -> tuple[str | None, str]:
    """The tokenizer's split regex when it is plain byte-level BPE with a regex tiktoken
    reproduces; else None and why not."""
    pattern, why = _pattern(spec)
    if pattern is None:
        return None, why
    why = _model_refusal(spec)
    return (None, why) if why else (pattern, "")


def _model_refusal(spec: dict[str, Any]) -> str:
    """Why this tokenizer's model and normalizer are not plain byte-level BPE ('' when they are)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')!r}"
    if model.get("dropout"):
        return "BPE dropout"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "continuing_subword_prefix/end_of_word_suffix set"
    if model.get("byte_fallback"):
        return "byte_fallback"
    if spec.get("normalizer") is not None:
        return "a normalizer"
    if any(t.get("normalized") for t in spec.get("added_tokens") or ()):
        return "normalized added tokens (matched inside the segments)"
    return ""


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


def _engine_differences(pattern: str) -> tuple[str | None, str]:
    """Where onig and fancy-regex class characters differently for a known ``pattern``
    (gateway/tokenization/regex_classes.py): a regex class body ('' for none), or None and why."""
    return regex_classes.engine_differences(_KNOWN_PATTERNS[pattern])


def _differ_note(differ: str) -> str:
    return f" (text with characters the regex engines class differently goes to HF: [{differ}])" if differ else ""


def _self_check(serialized: str, encoder: FastEncoder, added: list[str], extra: Sequence[str] = ()) -> str:
    """The built-in corpus (and ``extra``) must encode the same, on a private HF copy. Text the fast
    encoder hands to HF is skipped, but most of the corpus must be compared (else nothing was)."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(serialized)
    contents = [a for a in added if a]
    inside = re.compile("|".join(map(re.escape, contents))) if contents else None
    texts = [
        t
        for t in (*_CORPUS, "".join(_CORPUS), *(t[i:] for t in _CORPUS for i in (1, 2, 3)), *extra)
        if inside is None or not inside.search(t)
    ]
    compared = 0
    for text in texts:
        got = encoder.encode(text)
        if got is None:
            continue
        if got != hf.encode(text, add_special_tokens=False).ids:
            return f"{SELF_CHECK_FAILED} on {text[:40]!r}"
        compared += 1
    if compared * 2 < len(texts):
        return f"self-check compared only {compared} of {len(texts)} texts (the rest went to HF)"
    return ""


# -- the model's own tiktoken ranks (Meta's Llama 3) ----------------------------------------------


def read_ranks(path: str | os.PathLike[str]) -> tuple[dict[bytes, int] | None, str]:
    """tiktoken's ranks from a file in its format (a "base64-token rank" line per token), or None
    and why not (SentencePiece's ``tokenizer.model`` is not)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        return None, f"ranks file unreadable: {err}"
    ranks: dict[bytes, int] = {}
    lines = [line for line in data.splitlines() if line]
    try:
        for line in lines:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):  # not two fields, not base64, not an integer
        return None, "ranks file is not in tiktoken's format"
    if not ranks or len(ranks) != len(lines) or len(set(ranks.values())) != len(ranks):
        return None, "ranks file has a token or a rank twice"
    return ranks, ""


def vocabulary_ranks(spec: dict[str, Any]) -> tuple[dict[bytes, int] | None, str]:
    """tiktoken's ranks read off a byte-level tokenizer.json: each vocabulary token's bytes (GPT-2's
    byte-to-character alphabet read back) ranked by its id, added tokens aside. For a tokenizer.json
    converted from tiktoken ranks (Meta's Llama 3: ``original/tokenizer.model``) these are those
    ranks, exactly (a test compares them). None and why not when a token is not made of bytes."""
    decoder = _byte_decoder()
    table = {ord(ch): b for ch, b in decoder.items()}
    other = re.compile("[^" + "".join(map(re.escape, decoder)) + "]")
    added = {t["content"] for t in spec.get("added_tokens") or ()}
    vocab: dict[str, int] = (spec.get("model") or {}).get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for token, tid in vocab.items():
        if token in added:
            continue
        if other.search(token):
            return None, f"vocabulary token {tid} is not made of bytes"
        ranks[token.translate(table).encode("latin-1")] = int(tid)
    if not ranks or len(set(ranks.values())) != len(ranks):
        return None, "no vocabulary, or two tokens with one id"
    return ranks, ""


def load_ranks(
    spec: dict[str, Any], serialized: str, path: str | os.PathLike[str] | None = None
) -> tuple[FastEncoder | None, str]:
    """A fast encoder from tiktoken ranks that are the vocabulary's ids, for a tokenizer.json
    ``load`` refuses; None and why not. Its ids are checked, not proven, so they are sampled at run
    time. The ranks: the model's own ranks file (``path``: Meta's ``original/tokenizer.model``)
    where given, in tiktoken's format and holding exactly the vocabulary's tokens and ids; else,
    or when it is not that, ``vocabulary_ranks`` (the same ranks: what follows checks them alike).

    Checked here, in order: the tokenizer.json is the byte-level BPE with a known regex that
    tiktoken reproduces (as in ``load``) and ``ignore_merges`` is on (both return a piece that is a
    token whole); the ranks are exactly the vocabulary's ids; the merge list is exactly every split
    of every token into two tokens, in the order of the ids they make (Meta's converter). Then at
    every step both algorithms have the same candidate pairs and merge one making the lowest id,
    so they can only part at a step where two *different* merges make that token at once (HF
    takes the lower merge, tiktoken the leftmost). The most direct case, overlapping merges
    (x+y and y+z, y a border of the token), is in the corpus for every token that has one, with
    runs of many characters up to 1000 (whitespace and rules have the most merges per token) and
    ``_CORPUS``. That is evidence, not a proof: ``RunTimeCheck`` keeps looking on live text.
    """
    pattern, why = _byte_level_bpe(spec)
    if pattern is None:
        return None, why
    model = spec["model"]
    if not model.get("ignore_merges"):
        return None, "ignore_merges is off"
    added = spec.get("added_tokens") or []
    contents = [t["content"] for t in added]
    ranks, why = vocabulary_ranks(spec)
    if ranks is None:
        return None, why
    source = "tokenizer.json's vocabulary"
    if path is not None:
        from_file, why = read_ranks(path)
        if from_file is not None and not (why := _same_ranks(ranks, from_file)):
            ranks, source = from_file, f"the ranks in {Path(path).name}"  # the same ranks, just checked
        else:
            source += f" ({Path(path).name} left aside: {why})"
    borders, why = _merges_are_all_splits(model)
    if why:
        return None, why
    differ, why = _engine_differences(pattern)
    if differ is None:
        return None, why
    ids = set(ranks.values())
    specials = {t["content"]: int(t["id"]) for t in added if int(t["id"]) not in ids}
    encoding = tiktoken.Encoding("pdgate-ranks", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    encoder = FastEncoder(encoding, sampled=True, differ=differ)
    why = _self_check(serialized, encoder, contents, [*_runs(), *_texts(borders)])
    if why:
        return None, why
    return encoder, f"enabled from {source} (checked; sampled at run time){_differ_note(differ)}"


def _same_ranks(vocabulary: dict[bytes, int], ranks: dict[bytes, int]) -> str:
    """The ranks file must hold exactly the vocabulary's tokens (``vocabulary_ranks``) and ids."""
    for raw, tid in vocabulary.items():
        if ranks.get(raw) != tid:
            return f"vocabulary token {tid} has another rank in the ranks file"
    if len(ranks) != len(vocabulary):
        return "the ranks file has tokens the vocabulary lacks"
    return ""


def _merges_are_all_splits(model: dict[str, Any]) -> tuple[list[tuple[str, str, str]], str]:
    """The merge list must be every split of every token into two tokens, ordered by the id of
    the token each makes. Returns the overlapping pairs where HF and tiktoken could still part:
    (x, y, z) with x+y == y+z a token and x, y, z tokens (byte-level text)."""
    vocab: dict[str, int] = model.get("vocab") or {}
    merges = model.get("merges") or ()
    last = -1
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        tid = vocab.get(left + right)
        if tid is None or left not in vocab or right not in vocab:
            return [], f"merge {left!r} {right!r} does not join two tokens into one"
        if tid < last:
            return [], f"merges are not ordered by the ids they make (at {left + right!r})"
        last = tid
    has = vocab.__contains__
    splits = 0
    borders: list[tuple[str, str, str]] = []
    for token in vocab:
        n = len(token)
        for k in range(1, n):
            if has(token[:k]) and has(token[k:]):
                splits += 1
                # y = token[k:] is also the token's prefix: x+y and y+z make it, overlapping in y
                if token[:k] != token[k:] and token.startswith(token[k:]) and has(token[n - k :]):
                    borders.append((token[:k], token[k:], token[n - k :]))
    if splits != len(merges) or len({m if isinstance(m, str) else " ".join(m) for m in merges}) != len(merges):
        return [], "the merge list is not every split of every token"
    return borders, ""


def _runs() -> list[str]:
    """Runs of one character at many lengths (whitespace, rules, indentation: where most tokens have
    several merges), alone and after a space or a newline."""
    chars = " \n\t-=*#_./~+`'\"<>|\\!?:;,()[]{}0a1é\u3000ー。あ漢"
    lengths = (*range(1, 70), 100, 127, 128, 129, 255, 256, 257, 511, 1000)
    return [f"{lead}{c * n}" for c in chars for n in lengths for lead in ("", " ", "\n")]


def _texts(borders: list[tuple[str, str, str]]) -> list[str]:
    """Texts holding x+y+z for each overlapping pair of merges (alone; after a space, before z),
    where they are valid UTF-8."""
    decoder = _byte_decoder()
    out: list[str] = []
    for x, y, z in borders:
        for word in (x + y + z, "Ġ" + x + y + z + z):
            try:
                out.append(bytes(decoder[ch] for ch in word).decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return out


# -- sampling live text ------------------------------------------------------------------------

_queue: queue.Queue[tuple[RunTimeCheck, str, list[int]]] = queue.Queue(maxsize=_PENDING)
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()
_mismatches: dict[str, int] = {}
_mismatches_lock = threading.Lock()


class RunTimeCheck:
    """Encodes 1 in ``every`` texts again with the exact encoder (``reference``) on a background
    thread (shared by all models; tiktoken and tokenizers release the GIL), so the fast path
    stays checked on the text it actually sees. ``on_mismatch(text)`` runs on that thread."""

    def __init__(
        self,
        model: str,
        reference: Callable[[str], list[int]],
        on_mismatch: Callable[[str], None],
        every: int = SAMPLE_EVERY,
    ) -> None:
        self.model = model
        self.every = max(every, 1)
        self.checked = 0  # samples compared
        self.dropped = 0  # samples dropped while the queue was full
        self.active = True
        self._reference = reference
        self._on_mismatch = on_mismatch
        self._seen = itertools.count()  # atomic under the GIL
        with _mismatches_lock:
            _mismatches.setdefault(model, 0)

    def offer(self, text: str, ids: list[int]) -> None:
        """Queue this text for checking if it is the sample's turn (never blocks)."""
        if next(self._seen) % self.every or not self.active:
            return
        _start_worker()
        try:
            _queue.put_nowait((self, text, ids))
        except queue.Full:
            self.dropped += 1

    def check(self, text: str, ids: list[int]) -> None:
        if not self.active:
            return
        want = self._reference(text)
        self.checked += 1
        if want != ids:
            count_mismatch(self.model)
            self._on_mismatch(text)


def _start_worker() -> None:
    global _worker
    if _worker is not None:
        return
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_run, name="pdgate-fasttok-check", daemon=True)
            _worker.start()


def _run() -> None:
    while True:
        check, text, ids = _queue.get()
        try:
            check.check(text, ids)
        except Exception:  # a broken check must not stop the others
            log.exception("fast tokenizer run-time check failed to run")
        finally:
            _queue.task_done()


def _after_fork() -> None:
    """A forked child has no worker thread (nor a usable queue): start afresh."""
    global _worker, _worker_lock, _queue
    _worker, _worker_lock = None, threading.Lock()
    _queue = queue.Queue(maxsize=_PENDING)


os.register_at_fork(after_in_child=_after_fork)


def drain() -> None:
    """Wait until every queued sample has been checked (tests, benchmarks)."""
    _queue.join()


def count_mismatch(model: str) -> None:
    """Count one text whose fast ids differed from the exact ones (``mismatches``)."""
    with _mismatches_lock:
        _mismatches[model] = _mismatches.get(model, 0) + 1


def mismatches() -> dict[str, int]:
    """Mismatches found per model since the process started (models with a sampled fast path
    appear at 0); gateway.ops.metrics exports them as pdgate_tokenizer_fastpath_mismatches_total."""
    with _mismatches_lock:
        return dict(_mismatches)
