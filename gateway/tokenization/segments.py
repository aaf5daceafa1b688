"""Reusing token ids across a conversation's turns: ``SegmentEncoder``.

A conversation comes back with one more turn. ``SegmentEncoder`` reuses the ids of the text between
the tokenizer's added tokens (one segment per message in chat formats with special header tokens),
so only the new turn's text is tokenized again, with ids provably equal to encoding the whole text;
when the previous turn's text starts the new one, its ids are taken whole up to one of its added
tokens, so the long shared part is not even split and looked up again. It trusts segmenting only
for tokenizers whose every component works piece by piece (checked on the tokenizer's JSON, then on
probe texts at load). Where ``fasttok`` proves tiktoken's encoder equivalent for a byte-level BPE,
a segment is encoded by it; ``tokenizer.ModelTokenizer`` owns one encoder per model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from gateway.tokenization import fasttok

log = logging.getLogger(__name__)


# Components that process each piece of text on its own, whatever its position in the whole text
# (checked against tokenizers' Rust sources, 0.20-0.23). Metaspace is listed but refused with
# prepend_scheme "first", which looks at the piece's offset in the whole text.
_PIECEWISE_NORMALIZERS = frozenset(
    {
        "BertNormalizer",
        "ByteLevel",
        "Lowercase",
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Nmt",
        "Precompiled",
        "Prepend",
        "Replace",
        "Sequence",
        "Strip",
        "StripAccents",
    }
)
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "FixedLength",
        "Metaspace",
        "Punctuation",
        "Sequence",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)
_MODELS = frozenset({"BPE", "Unigram", "WordLevel", "WordPiece"})
# Texts the encoder checks itself on before it trusts segmenting (defense in depth: a mismatch turns
# segmenting off). {0} and {1} are added tokens.
_PROBES = ("{0}", "a{0}b", " {0} x{1}\n\n y ", "{0}{1}{0}", "\n\n{0}\n\nhello  world\n{1}", "é{0}ü {1}\t")


def _components(node: Any, children: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's JSON, flattened through its Sequences."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [c for child in node.get(children) or () for c in _components(child, children)]
    return [node]


def _affixes(proc: dict[str, Any] | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids a post-processor adds before and after a single sequence with add_special_tokens,
    or None for processors whose effect is not a fixed prefix and suffix."""
    if proc is None or proc.get("type") == "ByteLevel":  # ByteLevel only trims offsets
        return (), ()
    kind = proc.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return (int(proc["cls"][1]),), (int(proc["sep"][1]),)
    if kind == "TemplateProcessing":
        single, specials = proc.get("single") or [], proc.get("special_tokens") or {}
        seqs = [i for i, piece in enumerate(single) if "Sequence" in piece]
        if len(seqs) != 1 or single[seqs[0]]["Sequence"].get("id") != "A":
            return None
        try:
            ids = [tuple(specials[p["SpecialToken"]["id"]]["ids"]) if "SpecialToken" in p else () for p in single]
        except KeyError:
            return None
        return tuple(t for part in ids[: seqs[0]] for t in part), tuple(t for part in ids[seqs[0] + 1 :] for t in part)
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for inner in proc.get("processors") or ():  # applied in order: each wraps the previous result
            got = _affixes(inner)
            if got is None:
                return None
            prefix, suffix = got[0] + prefix, suffix + got[1]
        return prefix, suffix
    return None


def _not_piecewise(spec: dict[str, Any]) -> str | None:
    """Why the tokenizer (its JSON ``spec``) may encode a piece differently alone than inside a
    whole text, or None when its model, normalizers and pre-tokenizers all work piece by piece."""
    model = spec.get("model") or {}
    if model.get("type") not in _MODELS:
        return f"model {model.get('type')!r}"
    if model.get("dropout"):
        return "BPE dropout"
    for node in _components(spec.get("normalizer"), "normalizers"):
        if node.get("type") not in _PIECEWISE_NORMALIZERS:
            return f"normalizer {node.get('type')!r}"
    for node in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if node.get("type") not in _PIECEWISE_PRE_TOKENIZERS:
            return f"pre-tokenizer {node.get('type')!r}"
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return "Metaspace prepend_scheme 'first' depends on the piece's position"
    return None


@dataclass(frozen=True, slots=True, eq=False)
class _Encoded:
    """A recently encoded text, kept so that a longer text starting with it (the conversation's
    next turn) reuses its ids up to one of its added tokens (``SegmentEncoder._reusable``).
    Compared by identity (the record store removes the very record a new turn supersedes)."""

    text: str
    ends: tuple[int, ...]  # offsets just past each added-token match, ascending
    counts: tuple[int, ...]  # len(ids) before each of those offsets
    ids: list[int]  # without the post-processor's prefix and suffix; never mutated (a list slices
    # into a new list ~3x faster than a tuple converts to one)


class _RecentTexts:
    """Recently encoded texts by their first ``KEY_CHARS`` characters (shorter texts are not kept:
    cheap to encode anyway), several per key (conversations may share a system prompt), LRU-bounded
    by the ids they hold. Not thread-safe: the encoder's lock guards it."""

    KEY_CHARS = 256
    PER_KEY = 16

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(max_tokens, 0)
        # A key's records are replaced, never mutated in place: the cache sizes a value when stored.
        self._data: LRUCache[str, tuple[_Encoded, ...]] = LRUCache(
            maxsize=self.max_tokens, getsizeof=lambda recs: sum(len(r.ids) for r in recs)
        )

    @property
    def tokens(self) -> int:
        return int(self._data.currsize)

    def get(self, text: str) -> list[_Encoded]:
        if len(text) < self.KEY_CHARS:
            return []
        return list(self._data.get(text[: self.KEY_CHARS], ()))

    def put(self, rec: _Encoded, replaces: _Encoded | None) -> None:
        if len(rec.text) < self.KEY_CHARS:
            return
        key = rec.text[: self.KEY_CHARS]
        recs = [rec, *(r for r in self._data.pop(key, ()) if r is not replaces)][: self.PER_KEY]
        while recs and sum(len(r.ids) for r in recs) > self.max_tokens:
            recs.pop()  # more than the whole bound under one key: the oldest go
        if recs:
            self._data[key] = tuple(recs)

    def clear(self) -> None:
        self._data.clear()


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (chunk compares, then a binary search)."""
    n = min(len(a), len(b))
    lo, step = 0, 1024
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SegmentEncoder:
    """``backend.encode(text, add_special_tokens).ids``, reusing the ids of recently seen text
    between added tokens, so that a conversation coming back with one more turn only tokenizes
    its new messages.

    Why the ids are exactly the whole text's: the Rust tokenizer first cuts the raw text at its
    non-normalized added tokens (leftmost-longest literal matches), then normalizes, pre-tokenizes
    and models every piece on its own (``AddedVocabulary::extract_and_normalize``); ids(text) is
    the concatenation of the pieces' ids and the added tokens' ids. No match starts inside a piece
    (matching is leftmost), so a piece encoded alone is cut nowhere and yields the same ids. That
    holds when: no non-normalized added token has ``lstrip``, ``rstrip`` or ``single_word`` (they
    look at, or swallow, the neighbours' text); ``encode_special_tokens`` is off; the normalizer,
    pre-tokenizer and model are built-in ones that do not depend on a piece's offset (Metaspace
    with ``prepend_scheme: first`` does) or on chance (BPE dropout). Otherwise, or if a self-check
    on probe texts disagrees, every call encodes the whole text (``reason`` says why).

    With ``add_special_tokens``, the post-processor's prefix and suffix are added when it is one
    whose effect is a fixed prefix and suffix (template, BERT, RoBERTa, byte-level, sequences).

    The cache is a thread-safe LRU bounded by the token ids it holds (``max_tokens``; 0: no reuse);
    tokenizing itself runs outside the lock, on the caller's thread.

    Recent whole texts are kept too (bounded the same way), so that a conversation's next turn,
    whose text starts with the previous turn's, is not split and looked up again segment by
    segment: ids up to an added token of the previous text are reused, and only the rest is split
    and encoded. Why that is exact: the matches of added tokens are found left to right, and
    whether one starts at a position depends only on the next ``L`` characters (``L``: the longest
    added token), so if the two texts agree up to ``b + L - 1`` where a match of the previous
    text ends at ``b``, both texts have the same matches up to ``b``, and the scan of the rest
    starts afresh at ``b``.

    With ``fast``, the text between added tokens is encoded by ``fasttok`` (tiktoken) where that is
    proven to give the same ids (``fast_reason`` says why not otherwise), else by ``backend``. For a
    tokenizer.json that proof refuses (Meta's Llama 3), tiktoken ranks that are its vocabulary's ids
    are tried (``fasttok.load_ranks``: the model's own ``ranks_file`` where there is one, else read
    off the vocabulary): checked at load, not proven, so 1 in ``sample_every`` texts it
    encodes is encoded again by ``backend`` off the hot path (``fasttok.RunTimeCheck``), and a
    mismatch turns it off for this encoder's life (WARNING once,
    ``pdgate_tokenizer_fastpath_mismatches_total``; the caches, which may hold its ids, emptied).
    """

    def __init__(
        self,
        backend: Any,
        max_tokens: int = 1 << 20,
        *,
        fast: bool = False,
        ranks_file: str | os.PathLike[str] | None = None,
        model: str = "",
        sample_every: int | None = None,
    ) -> None:
        self._backend = backend
        self.max_tokens = max_tokens
        self._fast: fasttok.FastEncoder | None = None
        self._want_fast = fast
        self._ranks_file = ranks_file
        self._model = model
        self._sample_every = fasttok.SAMPLE_EVERY if sample_every is None else sample_every
        self._check: fasttok.RunTimeCheck | None = None
        self._generation = 0  # bumped when the fast path is turned off: older ids are not cached
        self.fast_reason = "disabled" if not fast else "segmenting is off"
        self._max_entry = max(max_tokens, 0) // 8  # one huge message must not flush the rest
        self._lock = threading.Lock()
        self._lru: LRUCache[str, tuple[int, ...]] = LRUCache(maxsize=max(max_tokens, 0), getsizeof=len)
        self._split: re.Pattern[str] | None = None
        self._added: dict[str, int] = {}
        self._affixes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._longest = 0  # characters of the longest added token
        self._recent = _RecentTexts(max_tokens)
        self.reason: str | None = "disabled" if max_tokens <= 0 and not fast else None
        if self.reason is None:
            self.reason = self._setup()

    @property
    def enabled(self) -> bool:
        """Whether ids of segments are reused across calls."""
        return self.reason is None and self.max_tokens > 0

    @property
    def fast(self) -> bool:
        """Whether segments are encoded by the fast encoder."""
        return self._fast is not None

    @property
    def fast_checked(self) -> bool:
        """Whether that fast encoder's ids are checked (sampled) rather than proven: then the exact
        tokenizer decides near the context limit (``ModelTokenizer``)."""
        fast = self._fast
        return fast is not None and fast.sampled

    @property
    def run_time_check(self) -> fasttok.RunTimeCheck | None:
        """The sampling of a checked fast encoder's ids (None: none running)."""
        return self._check

    def _setup(self) -> str | None:
        """Check the tokenizer's settings; return why segmenting is not exact, or None."""
        try:
            serialized = self._backend.to_str()
            spec = json.loads(serialized)
        except Exception as err:  # custom Python components do not serialize: nothing to prove with
            return f"tokenizer settings unreadable: {type(err).__name__}"
        if getattr(self._backend, "encode_special_tokens", False):
            return "encode_special_tokens is on"
        why = _not_piecewise(spec)
        if why is not None:
            return why
        added = [t for t in spec.get("added_tokens") or () if not t.get("normalized")]
        for tok in added:
            if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
                return f"added token {tok.get('content')!r} has lstrip/rstrip/single_word"
        if not added:
            return "no added tokens to split at"
        self._added = {t["content"]: int(t["id"]) for t in added}
        self._longest = max(map(len, self._added))
        # Python's regex alternation takes the first alternative that matches at the leftmost
        # position: longest first makes it leftmost-longest, like the tokenizer's Aho-Corasick.
        alternatives = sorted(self._added, key=lambda c: (-len(c), c))
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._affixes = _affixes(spec.get("post_processor"))
        if self._want_fast:
            self._load_fast(spec, serialized)
        why = self._self_check(serialized, alternatives)
        if why is not None:
            self._fast, self.fast_reason = None, "segmenting is off"
        elif self._fast is not None and self._fast.sampled:
            self._check = fasttok.RunTimeCheck(
                self._model,
                lambda text: self._backend.encode(text, add_special_tokens=False).ids,
                self._fast_mismatch,
                self._sample_every,
            )
            log.info("model %s: fast tokenizer %s", self._model, self.fast_reason)
        return why

    def _load_fast(self, spec: dict[str, Any], serialized: str) -> None:
        """The fast encoder: proven from the tokenizer's JSON, else checked from tiktoken ranks (the
        model's ranks file, or its vocabulary's ids)."""
        from tokenizers import Tokenizer

        if not isinstance(self._backend, Tokenizer):
            # A wrapper may encode differently from what its JSON describes: only the plain one.
            self.fast_reason = "backend is not a tokenizers.Tokenizer"
            return
        self._fast, self.fast_reason = fasttok.load(spec, serialized)
        if self._fast is None:
            refused = self.fast_reason
            self._fast, why = fasttok.load_ranks(spec, serialized, self._ranks_file)
            self.fast_reason = why
            if self._fast is None:
                if why != refused:
                    source = self._ranks_file if self._ranks_file is not None else "ranks from its vocabulary"
                    self.fast_reason = f"{refused}; {source}: {why}"
                if fasttok.SELF_CHECK_FAILED in why:  # the ranks encode differently
                    fasttok.count_mismatch(self._model)
                    log.warning("model %s: no fast tokenizer: %s", self._model, self.fast_reason)
        if self._fast is None:
            log.debug("tokenizer: no fast encoder (%s)", self.fast_reason)

    def _fast_mismatch(self, text: str) -> None:
        """A sampled text's fast ids were not the exact ones: off for this encoder's life, and the
        caches (which may hold such ids) emptied. Runs on the check's thread."""
        with self._lock:
            check, self._check = self._check, None
            if check is None:
                return  # already off
            check.active = False
            self._fast = None
            self.fast_reason = f"off: its ids differed from the Rust tokenizer's on {text[:40]!r}"
            self._generation += 1
            self._lru.clear()
            self._recent.clear()
        log.warning(
            "model %s: fast tokenizer turned off: its ids differed from the Rust tokenizer's on a "
            "sampled text (%d chars, starting %r); the routing decisions of requests "
            "tokenized before may have used wrong counts",
            self._model,
            len(text),
            text[:40],
        )

    def _self_check(self, serialized: str, tokens: list[str]) -> str | None:
        """Segmented and whole encodings of probe texts must agree, on a private copy of the
        tokenizer (the live one's caches and callers see nothing of it)."""
        from tokenizers import Tokenizer

        live, self._backend = self._backend, Tokenizer.from_str(serialized)
        try:
            for probe in _PROBES:
                text = probe.format(tokens[0], tokens[-1])
                for special in (False, True):
                    if special and self._affixes is None:
                        continue
                    want = self._backend.encode(text, add_special_tokens=special).ids
                    if self._encode(text, special, cache=False) != want:
                        self._split = None
                        return f"self-check failed on {text!r}"
        finally:
            self._backend = live
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids ``backend.encode(text, add_special_tokens)`` returns. Text without added tokens
        is encoded whole and not cached (a plain completion prompt has no turns to reuse)."""
        if (
            self._split is None
            or (add_special_tokens and self._affixes is None)
            or (self._fast is None and self.max_tokens <= 0)
        ):  # nothing to gain from splitting
            ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        return self._encode(text, add_special_tokens, cache=self.max_tokens > 0)

    def _encode(self, text: str, add_special_tokens: bool, *, cache: bool) -> list[int]:
        assert self._split is not None
        generation = self._generation
        last, start, ids = self._reusable(text) if cache else (None, -1, [])
        base = last.ends[start] if last is not None else 0
        parts = self._split.split(text[base:] if base else text)  # text, token, text, ..., text
        if len(parts) == 1 and last is None:
            if self._fast is None:  # no added token: no turns to reuse either
                whole: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
                return whole
            cache = False  # keep the cache for turns
        ends = list(last.ends[: start + 1]) if last is not None else []
        counts = list(last.counts[: start + 1]) if last is not None else []
        added = self._added
        offset = base
        for i, part in enumerate(parts):
            offset += len(part)
            if i % 2:
                ids.append(added[part])
                ends.append(offset)
                counts.append(len(ids))
            elif part:
                got = self._get(part) if cache else None
                if got is None:
                    got = self._segment(part)
                    if cache:
                        self._put(part, got, generation)
                ids.extend(got)
        if cache:
            self._remember(_Encoded(text, tuple(ends), tuple(counts), ids[:]), last, generation)
        if add_special_tokens and self._affixes:
            return [*self._affixes[0], *ids, *self._affixes[1]]
        return ids

    def _reusable(self, text: str) -> tuple[_Encoded | None, int, list[int]]:
        """The recent text whose ids ``text`` can reuse the most of, the index of the match end up
        to which it can (see the class docstring), and those ids; (None, -1, []) for none."""
        with self._lock:
            candidates = self._recent.get(text)
        best, best_at, reach = None, -1, 0
        margin = self._longest - 1
        # Usually the previous turn's text starts the new one (a memcmp each); else the most
        # recent few are compared character by character.
        prefixes = [rec for rec in candidates if text.startswith(rec.text)] or candidates[:3]
        for rec in prefixes:
            shared = len(rec.text) if text.startswith(rec.text) else _common_prefix(text, rec.text)
            at = bisect_right(rec.ends, shared - margin) - 1
            if at >= 0 and rec.ends[at] > reach:
                best, best_at, reach = rec, at, rec.ends[at]
        if best is None:
            return None, -1, []
        return best, best_at, best.ids[: best.counts[best_at]]

    def _remember(self, rec: _Encoded, last: _Encoded | None, generation: int) -> None:
        if len(rec.ids) > self._max_entry or not rec.ends:
            return
        with self._lock:
            if generation == self._generation:
                self._recent.put(rec, last if last is not None and rec.text.startswith(last.text) else None)

    def _segment(self, text: str) -> tuple[int, ...]:
        """Ids of text without added tokens."""
        fast = self._fast
        ids = fast.encode(text) if fast is not None else None
        if ids is None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            check = self._check
            if check is not None:
                check.offer(text, ids)
        return tuple(ids)

    def _get(self, key: str) -> tuple[int, ...] | None:
        with self._lock:
            return self._lru.get(key)

    def _put(self, key: str, ids: tuple[int, ...], generation: int) -> None:
        if len(ids) > self._max_entry:
            return
        with self._lock:
            if generation != self._generation:
                return  # encoded before the fast path was turned off
            self._lru[key] = ids  # the least recently used go until the ids fit

    def cached_tokens(self) -> int:
        """Token ids held by the cache (its memory bound)."""
        return int(self._lru.currsize)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._recent.clear()
