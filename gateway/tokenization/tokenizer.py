"""Token ids of a request's prompt, computed the way the engine computes them.

Loading mirrors vLLM's: transformers' AutoTokenizer (a local folder or a hub name) with
``truncation_side="left"``, as vLLM loads tokenizers for generative models. Chat prompts follow
``engine_model.chat``'s rules, are rendered to text and encoded by the Rust tokenizer directly (the same
ids as the transformers wrapper, at well under half the cost). Truncation and length checks follow
vLLM's ``TokenizeParams`` (``vllm/renderers/params.py``).

Tokenizing a long prompt takes milliseconds, so ``Tokenizers`` runs it on a small thread pool (the
Rust tokenizer releases the GIL) and never on the event loop; request bodies of at most
``inline_max_bytes`` are cheaper to tokenize in place than to hand to a thread.

A conversation comes back with one more turn: ``SegmentEncoder`` reuses the ids of the text between
the tokenizer's added tokens (one segment per message in chat formats with special header tokens),
so only the new turn's text is tokenized again, with ids provably equal to encoding the whole text;
when the previous turn's text starts the new one, its ids are taken whole up to one of its added
tokens, so the long shared part is not even split and looked up again.
Where ``fasttok`` proves tiktoken's encoder equivalent for a byte-level BPE, that text is encoded by
it (several times faster than the Rust tokenizer); for Meta's Llama 3, whose tokenizer.json that
proof refuses, tiktoken runs on the model's own ranks file, checked at load and sampled at run time,
and the exact tokenizer decides near the context limit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cachetools import LRUCache

from engine_model import chat
from gateway.config import ModelConfig, TokenizerConfig
from gateway.http.errors import APIError, bad_request
from gateway.request.protocol import ParsedRequest, check_lengths
from gateway.tokenization import fasttok, hub

T = TypeVar("T")

log = logging.getLogger(__name__)
_IMPORT_LOCK = threading.Lock()

# vLLM renders these models' chat prompts with its own Python code (or tokenizer) instead of the
# Jinja chat template, so the gateway's chat counts for them are approximate.
_RENDERER_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "DeepseekV4ForConditionalGeneration": "deepseek_v4",
    "DeepseekV41ForCausalLM": "deepseek_v41",
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "MoonshotKimiaForCausalLM": "kimi_audio",
    "InklingForCausalLM": "inkling",
    "InklingForConditionalGeneration": "inkling",
}
_PLAIN_TOKENIZER_MODES = frozenset({"auto", "hf"})
# Renderers that still tokenize with the model's Hugging Face tokenizer: only chat counts differ.
_HF_TOKENIZER_RENDERERS = frozenset({"harmony", "kimi_k3", "cohere", "inkling"})
EMPTY_PROMPT = "The decoder prompt cannot be empty"
# A prompt counted by a checked (not proven) fast encoder this close to the context limit is
# re-encoded exactly before the length check: 1% of max_model_len, at least 64 tokens.
NEAR_LIMIT_SHARE = 0.01
NEAR_LIMIT_MIN = 64


# -- reusing the ids of segments between added tokens ---------------------------------------------

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
    tokenizer.json that proof refuses (Meta's Llama 3), the model's own tiktoken ``ranks_file`` is
    tried (``fasttok.load_ranks``): checked at load, not proven, so 1 in ``sample_every`` texts it
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

    def _setup(self) -> str | None:  # noqa: C901 - over the limit before it was set; to split
        """Check the tokenizer's settings; return why segmenting is not exact, or None."""
        try:
            serialized = self._backend.to_str()
            spec = json.loads(serialized)
        except Exception as err:  # custom Python components do not serialize: nothing to prove with
            return f"tokenizer settings unreadable: {type(err).__name__}"
        from tokenizers import Tokenizer

        if getattr(self._backend, "encode_special_tokens", False):
            return "encode_special_tokens is on"
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
        if self._want_fast and not isinstance(self._backend, Tokenizer):
            # A wrapper may encode differently from what its JSON describes: only the plain one.
            self.fast_reason = "backend is not a tokenizers.Tokenizer"
        elif self._want_fast:
            self._fast, self.fast_reason = fasttok.load(spec, serialized)
            if self._fast is None and self._ranks_file is not None:
                refused = self.fast_reason
                self._fast, self.fast_reason = fasttok.load_ranks(spec, serialized, self._ranks_file)
                if self._fast is None:
                    self.fast_reason = f"{refused}; {self._ranks_file}: {self.fast_reason}"
                    if fasttok.SELF_CHECK_FAILED in self.fast_reason:  # the ranks encode differently
                        fasttok.count_mismatch(self._model)
                        log.warning("model %s: no fast tokenizer: %s", self._model, self.fast_reason)
            if self._fast is None:
                log.debug("tokenizer: no fast encoder (%s)", self.fast_reason)
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


class PromptIds(list[list[int]]):
    """One token-id list per prompt (chat has one), as returned by ``prompt_ids``.

    ``approximate`` is True when the engine's count will differ from ``len(ids)``: media parts
    (the engine expands them into placeholder tokens the gateway cannot count) or a model vLLM
    renders with its own code; ``approximate_reason`` says which. The ids are still the text's.
    """

    def __init__(self, prompts: Iterable[list[int]], approximate_reason: str | None = None) -> None:
        super().__init__(prompts)
        self.approximate_reason = approximate_reason

    @property
    def approximate(self) -> bool:
        return self.approximate_reason is not None


@dataclass(frozen=True, slots=True)
class _Truncation:
    """A request's truncate_prompt_tokens, resolved as vLLM resolves it."""

    keep: int | None  # tokens to keep; None: no truncation
    side: str | None  # the side the request asked for; None: the tokenizer's (left)


def load_template(value: str | None) -> str | None:
    """A template as vLLM's --chat-template takes it: a file's text, else the value itself when it
    looks like a template (has braces or a newline)."""
    if value is None:
        return None
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"chat_template {value!r} looks like a file path, but it cannot be read: {err}") from None


def _model_config(cfg: ModelConfig) -> dict[str, Any]:
    """The model's config.json next to its tokenizer, if there is one (no download)."""
    from transformers.utils.hub import cached_file  # where it is defined (transformers.utils re-exports it)

    try:
        path = cached_file(
            cfg.tokenizer,
            "config.json",
            revision=cfg.tokenizer_revision,
            _raise_exceptions_for_missing_entries=False,
            local_files_only=True,
        )
        return json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except Exception:  # no config, or one we cannot read: nothing to detect from
        return {}


def find_ranks_file(cfg: ModelConfig) -> str | None:
    """The model's own tiktoken ranks next to its tokenizer (``fasttok.RANKS_FILES``: Meta's
    ``original/tokenizer.model``), when the folder or the local hub cache has one (no download)."""
    from transformers.utils.hub import cached_file  # where it is defined (transformers.utils re-exports it)

    for name in fasttok.RANKS_FILES:
        try:
            path = cached_file(
                cfg.tokenizer,
                name,
                revision=cfg.tokenizer_revision,
                _raise_exceptions_for_missing_entries=False,
                local_files_only=True,
            )
        except Exception:  # not there, or no cache to look in
            continue
        if path:
            return str(path)
    return None


def detect_renderer(cfg: ModelConfig) -> str | None:
    """Which of vLLM's own chat renderers this model gets (None: the Jinja template)."""
    if cfg.tokenizer_mode not in _PLAIN_TOKENIZER_MODES:
        return cfg.tokenizer_mode
    config = _model_config(cfg)
    if config.get("model_type") == "gpt_oss":
        return "harmony"
    for arch in config.get("architectures") or ():
        if arch in _RENDERER_ARCHITECTURES:
            return _RENDERER_ARCHITECTURES[arch]
    folder = Path(cfg.tokenizer)
    if (
        cfg.tokenizer_mode == "auto"
        and folder.is_dir()
        and any(folder.glob("consolidated*.safetensors"))
        and ((folder / "tekken.json").exists() or any(folder.glob("tokenizer.model.v*")))
    ):
        return "mistral"  # vLLM then uses mistral_common's tokenizer and renderer
    return None


class ModelTokenizer:
    """One model's tokenizer and chat template, with vLLM's prompt rules."""

    def __init__(
        self,
        hf_tokenizer: Any,
        cfg: ModelConfig,
        renderer: str | None = None,
        *,
        reuse_tokens: int = 1 << 20,
        fast: bool = True,
        ranks_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """``reuse_tokens``: token ids of recent text segments kept for reuse, and as many again of
        recent whole texts (0: none; about 40 bytes each, plus the texts); ``fast``: encode with
        ``fasttok`` where proven exact, or checked from ``ranks_file`` (the model's tiktoken
        ranks, see ``find_ranks_file``). See ``SegmentEncoder``."""
        self.hf = hf_tokenizer
        self.cfg = cfg
        self._reuse_tokens = reuse_tokens
        self._fast = fast
        self._ranks_file = ranks_file
        # The Rust tokenizer underneath. A tokenizer.json may carry truncation or padding settings
        # that the transformers wrapper switches off on every call; encoding directly, do the same.
        backend = hf_tokenizer.backend_tokenizer
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self.backend = backend  # and the segment encoder around it (see the setter)
        self.server_template = load_template(cfg.chat_template)
        self.default_side: str = getattr(hf_tokenizer, "truncation_side", None) or "left"
        # vLLM refuses text longer than max_model_len x the longest vocabulary entry before it
        # tokenizes; this is the same bound, so the gateway refuses exactly that text.
        self.max_chars_per_token = max((len(t) for t in hf_tokenizer.get_vocab()), default=1)
        self.renderer = renderer
        self.kwargs_limits = chat.KwargsLimits(
            cfg.chat_template_kwargs_max_keys, cfg.chat_template_kwargs_max_depth, cfg.chat_template_kwargs_max_bytes
        )
        if not self.segments.enabled and reuse_tokens > 0:
            log.info("model %s: token ids are not reused across requests (%s)", cfg.name, self.segments.reason)
        if renderer is not None:
            log.warning(
                "model %s: vLLM renders its chat prompts with its own %r renderer; the gateway's "
                "chat token counts for it are approximate",
                cfg.name,
                renderer,
            )

    @property
    def backend(self) -> Any:
        """The Rust tokenizer that encodes the text."""
        return self._backend

    @backend.setter
    def backend(self, value: Any) -> None:
        # Every encode goes through the segment encoder: it must wrap whatever backend is set.
        self._backend = value
        self.segments = SegmentEncoder(
            value, self._reuse_tokens, fast=self._fast, ranks_file=self._ranks_file, model=self.cfg.name
        )

    @classmethod
    def load(cls, cfg: ModelConfig) -> ModelTokenizer:
        with _IMPORT_LOCK:  # transformers' lazy imports fail when two threads race through them
            from transformers import AutoTokenizer  # heavy import: only when a gateway starts

        # A hub name: ask the hub once, fast (gateway/tokenization/hub.py), rather than through a minute of the
        # library's retries; where it cannot serve, only the local hub cache can.
        problem = None if hub.is_local(cfg.tokenizer) else hub.probe(cfg.tokenizer, cfg.tokenizer_revision)
        try:
            hf = AutoTokenizer.from_pretrained(
                cfg.tokenizer,
                revision=cfg.tokenizer_revision,
                trust_remote_code=cfg.trust_remote_code,
                truncation_side="left",
                local_files_only=problem is not None,
            )
        except OSError:
            if problem is None:
                raise
            raise problem.unavailable() from None
        if problem is not None:
            log.log(
                logging.INFO if problem.chosen else logging.WARNING,
                "model %s: %s; its tokenizer comes from the local hub cache",
                cfg.name,
                problem.what,
            )
        return cls(hf, cfg, detect_renderer(cfg), ranks_file=find_ranks_file(cfg))

    # -- both ---------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> PromptIds:
        """One token list per prompt, truncated and length-checked as vLLM does (see PromptIds)."""
        body = req.body
        trunc = self._truncation(req)
        near = self._near_limit(body)
        reason = None
        if req.kind == "chat":
            rendered, media = self._render_chat(body)
            add_special = bool(body.get("add_special_tokens") or False)
            prompts = [self._text_ids(rendered, add_special, trunc, near)]
            reason = "multimodal" if media else self.renderer
        else:
            add_special = body.get("add_special_tokens") is not False
            prompts = [
                self._text_ids(p, add_special, trunc, near) if isinstance(p, str) else self._truncate(list(p), trunc)
                for p in req.prompts
            ]
            if self.renderer not in _HF_TOKENIZER_RENDERERS:
                reason = self.renderer  # vLLM tokenizes with that mode's own tokenizer
        if reason in (None, "multimodal"):
            # A model-specific renderer may count more or fewer tokens than this: let its engine judge.
            check_lengths(req, prompts, self.cfg.max_model_len)
        if reason is None and not all(prompts):
            raise bad_request(EMPTY_PROMPT)
        return PromptIds(prompts, reason)

    # -- chat ---------------------------------------------------------------------------------
    def _render_chat(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The rendered prompt text, and whether the messages have media parts. The template call
        never tokenizes: the tokenizer is shared by the tokenizing threads and only ever encodes
        text (``chat.check_template_kwargs`` refuses kwargs that would configure it)."""
        cfg = self.cfg
        try:
            chat.check_template_kwargs(body.get("chat_template_kwargs"), self.kwargs_limits)
        except chat.ChatTemplateError as err:
            raise bad_request(str(err), param=err.param, code="invalid_chat_template_kwargs") from None
        self._refuse_untrusted_template(body)
        tools = body.get("tools")
        if tools is not None and body.get("tool_choice") == "none" and cfg.exclude_tools_when_tool_choice_none:
            tools = None
        merged = chat.merged_kwargs(body, chat.normalize_tools(tools), cfg.default_chat_template_kwargs)
        given = body.get("chat_template") or self.server_template or merged.get("chat_template")
        try:
            template = chat.select_template(given, self.hf.chat_template, merged.get("tools"))
            fmt = cfg.chat_template_content_format
            if fmt == "auto":
                fmt = chat.detect_content_format(template)
            conversation, media = chat.normalize_messages(body["messages"], fmt)
            conversation = chat.for_template(conversation, template)
            args = chat.render_args(merged, template)
            text: str = self.hf.apply_chat_template(
                conversation, tools=args.tools, chat_template=template, tokenize=False, **args.kwargs
            )
        except chat.ChatTemplateError as err:
            raise bad_request(str(err), param=err.param) from None
        except Exception as err:  # templates raise to reject input (e.g. bad role order); vLLM answers 400
            raise bad_request(chat.template_error_reason(err)) from None
        return text, media

    def _refuse_untrusted_template(self, body: dict[str, Any]) -> None:
        kwargs = body.get("chat_template_kwargs") or {}
        if not self.cfg.trust_request_chat_template and (
            body.get("chat_template") is not None or kwargs.get("chat_template") is not None
        ):
            raise bad_request(
                "Chat template is passed with request, but --trust-request-chat-template is not set. "
                "Refused request with untrusted chat template.",
                param="chat_template",
            )

    # -- truncation and length ----------------------------------------------------------------
    def _truncation(self, req: ParsedRequest) -> _Truncation:
        body, max_len = req.body, self.cfg.max_model_len
        keep = body.get("truncate_prompt_tokens")
        if keep is None:
            return _Truncation(None, None)
        if keep > max_len:
            raise bad_request(
                f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {max_len}. "
                "Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if keep < 0:  # -1: as much as fits, leaving room for one output token when any is asked for
            keep = max_len - 1 if _max_output(req) else max_len
        return _Truncation(keep, body.get("truncation_side"))

    def _near_limit(self, body: dict[str, Any]) -> int:
        """Token count from which a checked (not proven) fast count is redone exactly: within
        ``NEAR_LIMIT_SHARE`` of max_model_len (at least ``NEAR_LIMIT_MIN`` tokens) of where
        ``check_lengths`` refuses, counting the room min_tokens needs."""
        limit = self.cfg.max_model_len
        margin = max(NEAR_LIMIT_MIN, int(limit * NEAR_LIMIT_SHARE))
        return limit - margin - max(body.get("min_tokens") or 0, 1)

    def _encode(self, text: str, add_special: bool, near: int) -> list[int]:
        """The segment encoder's ids; the exact tokenizer's when they came from a checked fast
        encoder and reach ``near``: whether vLLM refuses the prompt is decided by exact counts."""
        checked = self.segments.fast_checked  # before: a run-time mismatch may turn it off meanwhile
        ids = self.segments.encode(text, add_special)
        if checked and len(ids) >= near:
            exact: list[int] = self.backend.encode(text, add_special_tokens=add_special).ids
            return exact
        return ids

    def _text_ids(self, text: str, add_special: bool, trunc: _Truncation, near: int) -> list[int]:
        if trunc.keep == 0:
            return []  # vLLM cuts whatever the tokenizer returned down to nothing
        limit = self.cfg.max_model_len * self.max_chars_per_token
        if len(text) > limit and self.renderer is None:  # another tokenizer may have another bound
            if trunc.keep is None:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, your "
                    f"prompt contains {len(text)} characters (more than {limit} characters, which is the upper "
                    f"bound for {self.cfg.max_model_len} input tokens). Please reduce the length of the input "
                    "prompt.",
                    param="input_text",
                    code="context_length_exceeded",
                )
            if trunc.side == "left":
                text = text[-limit:]
            elif trunc.side == "right":
                text = text[:limit]
        if trunc.keep is None or trunc.side is not None:
            return self._truncate(self._encode(text, add_special, near), trunc)
        # vLLM has the tokenizer truncate: the special tokens stay, the text is cut on its side.
        enc = self.backend.encode(text, add_special_tokens=False)
        specials = self.backend.num_special_tokens_to_add(False) if add_special else 0
        enc.truncate(max(trunc.keep - specials, 0), direction=self.default_side)
        return self._truncate(self.backend.post_process(enc, add_special_tokens=add_special).ids, trunc)

    def _truncate(self, ids: list[int], trunc: _Truncation) -> list[int]:
        keep = trunc.keep
        if keep is None or len(ids) <= keep:
            return ids
        if keep == 0:
            return []
        return ids[-keep:] if (trunc.side or self.default_side) == "left" else ids[:keep]


def _max_output(req: ParsedRequest) -> int:
    """The output budget vLLM's TokenizeParams sees (completions default max_tokens to 16)."""
    body = req.body
    if req.kind == "chat":
        value = body.get("max_completion_tokens")
        if value is None:
            value = body.get("max_tokens")
    else:
        value = body.get("max_tokens")
        if value is None:
            value = 16
    return value or 0


class Tokenizers:
    """All configured models' tokenizers plus the pool that runs them off the event loop."""

    def __init__(self, models: Sequence[ModelTokenizer], cfg: TokenizerConfig) -> None:
        self._by_name = {m.cfg.name: m for m in models}
        self._cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tokenize")

    def get(self, model: str) -> ModelTokenizer | None:
        return self._by_name.get(model)

    async def prompt_ids(self, tok: ModelTokenizer, req: ParsedRequest) -> PromptIds:
        """``tok.prompt_ids(req)``, inline for small bodies, else on the pool.

        The body's size bounds the work: it counts everything that gets rendered or tokenized
        (text, token-id lists, tools, documents), unlike any count of prompt characters.
        """
        if req.raw_size <= self._cfg.inline_max_bytes:
            return tok.prompt_ids(req)
        return await asyncio.get_running_loop().run_in_executor(self._pool, tok.prompt_ids, req)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn`` on the tokenizer threads: other work with a tokenizer (replaying a migrated
        answer's output) stays off the event loop too."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self, *, cancel: bool = True) -> None:
        self._pool.shutdown(wait=False, cancel_futures=cancel)
