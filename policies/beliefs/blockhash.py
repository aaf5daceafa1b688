"""Prefix-cache block hashes, computed exactly as vLLM 0.32 computes them.

vLLM keys its prefix cache by chained block hashes: block ``i`` (``block_size`` prompt tokens)
hashes ``(parent hash, tuple(its token ids), extra keys)`` with the engine's
``--prefix-caching-hash-algo``; the first block's parent is ``NONE_HASH``, the same algorithm
applied to a seed string. Its KV cache events (``BlockStored``) publish these hashes, by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) as the unsigned 64-bit integer made of the last
8 bytes of the digest. ``block_hashes`` returns exactly those values, so the gateway can look the
engine's events up with hashes of the prompts it routes.

Engine settings the ``HashSpec`` must mirror for the hashes to be equal:

- ``--block-size`` (the engine's KV block size; ``vllm:cache_config_info`` shows it);
- ``--prefix-caching-hash-algo`` (``sha256`` default, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``);
- ``PYTHONHASHSEED`` of the engine processes: it is the ``NONE_HASH`` seed when set. When it is
  unset, sha256/sha256_cbor engines use the fixed seed ``"vllm-none-hash"`` (reproducible, so
  ``seed=None`` matches them), but xxhash engines draw a random seed per process: their hashes
  cannot be reproduced, ``HashSpec.reproducible`` is False, and the KV event subscriber
  translates engine hashes into the gateway's own chain from each event's token ids and parent
  hash instead (see ``gateway/engines/kvevents.py``);
- ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (``int_hashes``): 1 (default) publishes ints, 0 bytes.

Serialization facts (vLLM ``vllm/utils/hashing.py``, ``vllm/v1/core/kv_cache_utils.py``):
``sha256``/``xxhash`` hash ``pickle.dumps(obj, protocol=5)``; the ``*_cbor`` variants hash
``cbor2.dumps(obj, canonical=True)`` of the same object (the very call vLLM makes); xxhash means
the 128-bit ``xxh3_128`` digest. The object is ``(parent_digest: bytes, tokens: tuple[int, ...],
extra_keys: tuple | None)`` per block, and the seed string itself for ``NONE_HASH``. Extra keys,
in order: ``("lora", name, path)`` on every block of a LoRA request, multimodal keys,
``("cache_salt", salt)`` on the first block only, prompt embedding digests. The gateway supports
LoRA and cache_salt; prompts with media or embeddings are out of scope (their hashes depend on
processed media the gateway never sees).

``block_digests`` memoizes per ``HashSpec`` in a bounded LRU (``cachetools``) keyed by ``(parent
digest, block tokens, extra keys)``; ``block_hashes`` (the request path) reuses the last prompt of
a conversation instead: when it comes back with one more turn, only its new blocks are hashed.
Token ids must be Python ints (what the tokenizers library returns): numpy integers pickle
differently.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import cbor2
from cachetools import LRUCache

BlockHash = int | bytes
"""A block hash as vLLM publishes it in KV events: a 64-bit int (default) or the digest bytes."""

Digest = bytes
"""The full digest of one block, the value chained into the next block's hash."""

_Extra = tuple[Any, ...] | None  # a block's tagged extra keys
_MemoKey = tuple[Digest, tuple[int, ...], _Extra]  # (parent digest, block tokens, extra keys)
_RecentKey = tuple[bytes, _Extra, _Extra]  # (the first unit's packed token ids, first_extra, every_extra)

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs, until the engines report theirs
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic algos without PYTHONHASHSEED
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on the Pythons vLLM 0.32 supports


def cbor_dumps(obj: Any) -> bytes:
    """Canonical CBOR of ``obj``, exactly as vLLM's ``sha256_cbor``/``xxhash_cbor`` serialize it."""
    return cbor2.dumps(obj, canonical=True)


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


def _xxh3_128() -> Callable[[bytes], bytes]:
    try:
        import xxhash  # optional: only engines run with an xxhash algo need it
    except ImportError:
        raise ImportError("hash algo xxhash/xxhash_cbor needs the 'xxhash' package (pip install xxhash)") from None
    digest: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return digest


def _digest_fn(algo: str) -> Callable[[Any], bytes]:
    # vLLM's own call (vllm/utils/hashing.py); cbor2's C encoder, faster than a Python one.
    serialize = partial(cbor2.dumps, canonical=True) if algo.endswith("_cbor") else _pickle_dumps
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(serialize(obj)).digest()
    xxh = _xxh3_128()
    return lambda obj: xxh(serialize(obj))


@dataclass(slots=True)
class _Prompt:
    packed: bytes  # the hashed units' token ids as uint32s
    digests: list[Digest]
    published: list[BlockHash]


class _Recent:
    """Recent prompts by their first unit (and extra keys): a conversation that comes back with
    one more turn shares a long prefix with its last prompt, whose hashes are reused wholesale
    after a comparison of packed token ids, instead of a memo lookup per block. Several
    conversations may start alike (one system prompt), so each first unit keeps a few; the keys
    are an LRU (one lookup and one insert per request: cachetools' cost is noise there)."""

    __slots__ = ("_data",)
    PER_KEY = 8

    def __init__(self, maxsize: int) -> None:
        self._data: LRUCache[_RecentKey, list[_Prompt]] = LRUCache(maxsize)

    def best(self, key: _RecentKey, packed: bytes, unit_bytes: int) -> tuple[_Prompt | None, int]:
        """The remembered prompt sharing the most leading units with ``packed``, and how many."""
        prompts = self._data.get(key)  # a hit counts as a use
        if not prompts:
            return None, 0
        best, shared = None, 0
        for p in prompts:
            n = _common_units(p.packed, packed, unit_bytes)
            if n > shared:
                best, shared = p, n
        return best, shared

    def put(self, key: _RecentKey, prompt: _Prompt, replaces: _Prompt | None) -> None:
        prompts = self._data.get(key)
        if prompts is None:
            self._data[key] = prompts = []  # may evict the least recently used key
        if replaces is not None and replaces in prompts:
            prompts.remove(replaces)  # the conversation's previous turn: superseded
        prompts.insert(0, prompt)
        del prompts[self.PER_KEY :]

    def clear(self) -> None:
        self._data = LRUCache(self._data.maxsize)  # O(1): LRUCache.clear pops one entry at a time


def _common_units(a: bytes, b: bytes, unit_bytes: int) -> int:
    """How many leading ``unit_bytes``-long units ``a`` and ``b`` share (binary search, memcmp)."""
    lo, hi = 0, min(len(a), len(b)) // unit_bytes
    if a[: hi * unit_bytes] == b[: hi * unit_bytes]:
        return hi
    while lo < hi:  # invariant: lo units are shared, hi are not
        mid = (lo + hi + 1) // 2
        if a[: mid * unit_bytes] == b[: mid * unit_bytes]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, eq=False)
class HashSpec:
    """How one group of engines hashes prefix-cache blocks (see the module docstring).

    ``block_size``: the engine's KV block size. ``algo``: its ``--prefix-caching-hash-algo``.
    ``seed``: its ``PYTHONHASHSEED``, or None when unset. ``int_hashes``: its
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default on). ``hash_block_size``: only for hybrid
    models whose hash granularity (``prefix_match_unit``) is finer than the block size; each block
    hash is then the chained hash at the block's end boundary. ``memo_size``: blocks remembered.
    """

    block_size: int
    algo: HashAlgo = "sha256"
    seed: str | None = None
    int_hashes: bool = True
    hash_block_size: int | None = None
    memo_size: int = 65536
    recent_size: int = 256
    _digest: Callable[[Any], bytes] = field(init=False, repr=False)
    _none_hash: Digest = field(init=False, repr=False)
    _memo: LRUCache[_MemoKey, Digest] = field(init=False, repr=False)
    _recent: _Recent = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix caching hash algo {self.algo!r}; expected one of {HASH_ALGOS}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        unit = self.hash_block_size or self.block_size
        if unit <= 0 or self.block_size % unit:
            raise ValueError(f"block_size {self.block_size} must be a multiple of hash_block_size {unit}")
        if self.memo_size < 1 or self.recent_size < 1:
            raise ValueError("memo_size and recent_size must be positive")
        # An engine whose NONE_HASH is random cannot be reproduced: the gateway keeps its own
        # (sha256, default seed) chain and relies on event translation.
        algo = self.algo if self.reproducible else "sha256"
        digest = _digest_fn(algo)
        seed = self.seed if self.seed is not None else DEFAULT_NONE_HASH_SEED
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "_none_hash", digest(seed))
        object.__setattr__(self, "_memo", LRUCache(self.memo_size))
        object.__setattr__(self, "_recent", _Recent(self.recent_size))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[int, str, str | None, bool, int]:
        return (self.block_size, self.algo, self.seed, self.int_hashes, self.hash_block_size or self.block_size)

    @property
    def reproducible(self) -> bool:
        """Whether the gateway's hashes equal the engine's (False: xxhash without PYTHONHASHSEED)."""
        return self.seed is not None or not self.algo.startswith("xxhash")

    @property
    def unit(self) -> int:
        """Tokens per hashed unit (``hash_block_size``, normally the block size)."""
        return self.hash_block_size or self.block_size

    @property
    def none_hash(self) -> Digest:
        return self._none_hash

    def external(self, digest: Digest) -> BlockHash:
        """The value vLLM publishes in KV events for a block digest."""
        if self.int_hashes:
            return int.from_bytes(digest[-8:], "big")
        return digest

    def memo_len(self) -> int:
        return len(self._memo)

    def clear_memo(self) -> None:
        object.__setattr__(self, "_memo", LRUCache(self.memo_size))  # O(1), unlike LRUCache.clear
        self._recent.clear()


def block_digests(
    token_ids: Sequence[int],
    spec: HashSpec,
    *,
    parent: Digest | None = None,
    first_extra: tuple[Any, ...] | None = None,
    every_extra: tuple[Any, ...] | None = None,
) -> list[Digest]:
    """Chained digests of the full ``spec.unit``-token units of ``token_ids`` (hash granularity).

    ``parent`` continues a chain (None: the prompt starts here). ``first_extra`` are extra keys of
    the first unit only (cache_salt), ``every_extra`` of every unit (LoRA); both already tagged.
    """
    unit = spec.unit
    digest, memo = spec._digest, spec._memo
    prev = parent if parent is not None else spec._none_hash
    out: list[Digest] = []
    for start in range(0, len(token_ids) - unit + 1, unit):
        tokens = tuple(token_ids[start : start + unit])
        if first_extra and start == 0 and parent is None:
            extra: tuple[Any, ...] | None = (every_extra or ()) + first_extra  # vLLM's order
        else:
            extra = every_extra or None
        key = (prev, tokens, extra)
        h = memo.get(key)
        if h is None:
            h = digest(key)
            memo[key] = h
        out.append(h)
        prev = h
    return out


def _chain(
    token_ids: Sequence[int],
    spec: HashSpec,
    parent: Digest | None,
    first_extra: tuple[Any, ...] | None,
    every_extra: tuple[Any, ...] | None,
) -> list[Digest]:
    """``block_digests`` without the per-block memo: ``block_hashes`` reuses whole prompts
    instead (``_Recent``), and for a new prompt a memo probe per block costs 3x the hashing."""
    unit, digest = spec.unit, spec._digest
    prev = parent if parent is not None else spec._none_hash
    out: list[Digest] = []
    for start in range(0, len(token_ids) - unit + 1, unit):
        if first_extra and start == 0 and parent is None:
            extra: tuple[Any, ...] | None = (every_extra or ()) + first_extra  # vLLM's order
        else:
            extra = every_extra or None
        prev = digest((prev, tuple(token_ids[start : start + unit]), extra))
        out.append(prev)
    return out


def extra_keys(
    cache_salt: str | None = None, lora: tuple[str, str] | None = None
) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """vLLM's tagged extra keys for a request: (first block's, every block's)."""
    every = (("lora", lora[0], lora[1]),) if lora else None
    first = (("cache_salt", cache_salt),) if cache_salt else None
    return first, every


def block_hashes(
    token_ids: Sequence[int],
    spec: HashSpec,
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[BlockHash]:
    """The hashes vLLM publishes in ``BlockStored`` for the full blocks of this prompt, in order.

    ``cache_salt``: the request's ``cache_salt`` field. ``lora``: (adapter name, adapter path) of
    a LoRA request, as the engine registered it.
    """
    first, every = extra_keys(cache_salt, lora)
    unit = spec.unit
    units = len(token_ids) // unit
    if not units:
        return []
    step = spec.block_size // unit
    try:
        packed = _pack(token_ids, units * unit)
    except (OverflowError, TypeError):  # not uint32 token ids: no reuse, plain memoized hashing
        published = _publish(_chain(token_ids, spec, None, first, every), spec)
        return published[step - 1 :: step] if step != 1 else published
    unit_bytes = unit * 4
    key = (packed[:unit_bytes], first, every)
    last, shared = spec._recent.best(key, packed, unit_bytes)
    if last is not None and shared:
        digests = last.digests[:shared] + _chain(
            token_ids[shared * unit : units * unit], spec, last.digests[shared - 1], None, every
        )
        published = last.published[:shared] + _publish(digests[shared:], spec)
    else:
        digests = _chain(token_ids[: units * unit], spec, None, first, every)
        published = _publish(digests, spec)
    if last is None or shared < units or len(last.digests) <= units:
        # Remember this prompt, in place of the one it extends (a conversation's earlier turn).
        spec._recent.put(
            key, _Prompt(packed, digests, published), last if last is not None and shared == len(last.digests) else None
        )
    return published[step - 1 :: step] if step != 1 else list(published)


def _pack(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` token ids as uint32s (``array.fromlist`` converts a list ~1.5x faster than
    ``array(list)``, and the array is cut in place instead of slicing the list first)."""
    packed = array("I")
    if type(token_ids) is list:
        packed.fromlist(token_ids)
        del packed[n:]
    else:
        packed.extend(token_ids[:n])
    return packed.tobytes()


def _publish(digests: Sequence[Digest], spec: HashSpec) -> list[BlockHash]:
    """Per hashed unit, the value events carry (``block_hashes`` keeps the units ending a block)."""
    if not spec.int_hashes:
        return list(digests)
    return [int.from_bytes(d[-8:], "big") for d in digests]
