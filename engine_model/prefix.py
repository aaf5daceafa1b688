"""The KV block pool with vLLM 0.32's automatic prefix caching (``vllm/v1/core/block_pool.py``).

* Blocks have a reference count. Block 0 is the null block and never handed out.
* Free blocks sit in one queue, evicted from the head: a freed block that holds no cached KV
  goes to the head (reused first), a freed *cached* block to the tail, so cached blocks are
  evicted least recently freed first (LRU). A request frees its blocks last block first, so its
  tail is evicted before its head (a later request more likely shares the head).
* A full block whose KV is (being) computed is registered under its chained block hash
  (:mod:`policies.beliefs.blockhash`). Several blocks may hold the same hash (two requests computed
  the same prefix at once); a lookup takes the first.
* A new request's longest run of cached full blocks is reused ("touched": one more reference,
  taken out of the free queue); at most ``num_tokens - 1`` tokens, since the last prompt
  token must be computed to sample.
* Taking a free block that still holds a hash evicts it (``BlockRemoved``); registering a hash
  emits ``BlockStored`` (one event per request per step, for its run of newly cached blocks);
  ``reset`` succeeds only when no block is in use and emits ``AllBlocksCleared``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine_model.adapters import LoRARequest
from engine_model.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from policies.beliefs.blockhash import Digest, HashSpec, block_digests


def engine_hash_spec(block_size: int, algo: str) -> HashSpec:
    """The hashing an engine started with these settings uses, as vLLM resolves it: the NONE_HASH
    seed is ``PYTHONHASHSEED`` when set; otherwise sha256 variants use vLLM's fixed default seed
    and xxhash variants a random per-process seed (their hashes cannot be reproduced elsewhere).
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1) picks ints or digests for events."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None and algo.startswith("xxhash"):
        seed = os.urandom(32).hex()
    int_hashes = bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))
    return HashSpec(block_size=block_size, algo=algo, seed=seed, int_hashes=int_hashes)  # type: ignore[arg-type]


def extend_digests(
    digests: list[Digest],
    tokens: Sequence[int],
    n_blocks: int,
    spec: HashSpec,
    every_extra: tuple[Any, ...] | None = None,
) -> None:
    """Grow ``digests`` (a request's chained block digests) to cover its first ``n_blocks`` full
    blocks, hashing only the blocks not hashed yet. ``every_extra``: the extra key of every block
    (a LoRA request's ``(("lora", name, path),)``)."""
    have = len(digests)
    if have >= n_blocks:
        return
    bs = spec.block_size
    parent = digests[-1] if digests else None
    digests.extend(block_digests(tokens[have * bs : n_blocks * bs], spec, parent=parent, every_extra=every_extra))


class BlockPool:
    """Reference-counted KV blocks, the LRU free queue and the prefix-cache index."""

    def __init__(self, num_blocks: int, block_size: int, spec: HashSpec | None, events: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spec = spec  # None: prefix caching disabled
        self.emit = events and spec is not None
        self.ref = [0] * num_blocks
        self.digest: list[Digest | None] = [None] * num_blocks
        self.cached: dict[Digest, dict[int, None]] = {}
        # Eviction order: the first key is taken first. Block 0 (null) is never free.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.events: list[KVCacheEvent] = []

    @property
    def caching(self) -> bool:
        return self.spec is not None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return sum(len(b) for b in self.cached.values())

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: evictable cached blocks count as free."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    # ---------------------------------------------------------------- lookups
    def lookup(self, digests: Sequence[Digest], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached run of ``digests[:max_blocks]``."""
        out: list[int] = []
        cached = self.cached
        for d in digests[:max_blocks]:
            blocks = cached.get(d)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (a lookup's hits) sit in the free queue: touching them
        leaves that many fewer blocks to allocate from."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    # ---------------------------------------------------------------- allocation
    def touch(self, blocks: Sequence[int]) -> None:
        ref, free = self.ref, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks from the head of the free queue (evicting cached ones), or None."""
        if n > len(self.free):
            return None
        pop = self.free.popitem
        out = [pop(last=False)[0] for _ in range(n)]
        if self.cached:
            for b in out:
                if self.digest[b] is not None:
                    self._evict(b)
        for b in out:
            self.ref[b] = 1
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block. ``blocks`` are in request order; like vLLM the tail
        is freed first, so it is evicted first."""
        ref, free, digest = self.ref, self.free, self.digest
        uncached: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if digest[b] is None:
                    uncached.append(b)
                else:
                    free[b] = None  # tail: evicted last
        for b in reversed(uncached):  # head: reused first, in the order given
            free[b] = None
            free.move_to_end(b, last=False)

    # ---------------------------------------------------------------- caching
    def cache(
        self,
        blocks: Sequence[int],
        digests: Sequence[Digest],
        start: int,
        end: int,
        tokens: Sequence[int],
        lora: LoRARequest | None = None,
    ) -> None:
        """Register ``blocks[start:end]`` (full blocks of one request) under their digests and
        emit one BlockStored for the run. ``tokens``: the request's token ids (at least
        ``end * block_size`` of them). ``lora``: the request's adapter; the event names it (its int
        id and name) and gives each block the untagged key ``(name,)`` (vLLM's
        ``to_event_extra_keys``: the path is left out)."""
        if start >= end or self.spec is None:
            return
        for i in range(start, end):
            b, d = blocks[i], digests[i]
            if self.digest[b] is not None:
                continue  # a hit block: already registered under this digest
            self.digest[b] = d
            self.cached.setdefault(d, {})[b] = None
        if self.emit:
            ext = self.spec.external
            bs = self.block_size
            self.events.append(
                BlockStored(
                    block_hashes=[ext(digests[i]) for i in range(start, end)],
                    parent_block_hash=ext(digests[start - 1]) if start else None,
                    token_ids=list(tokens[start * bs : end * bs]),
                    block_size=bs,
                    lora_id=lora.int_id if lora is not None else None,
                    medium=MEDIUM_GPU,
                    lora_name=lora.name if lora is not None else None,
                    extra_keys=[(lora.name,) if lora is not None else None] * (end - start),
                    group_idx=0,
                )
            )

    def _evict(self, b: int) -> None:
        d = self.digest[b]
        self.digest[b] = None
        holders = self.cached.get(d) if d is not None else None
        if d is None or holders is None or b not in holders:
            return
        del holders[b]
        if not holders:
            del self.cached[d]
        if self.emit and d is not None and self.spec is not None:
            self.events.append(BlockRemoved(block_hashes=[self.spec.external(d)], medium=MEDIUM_GPU, group_idx=0))

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self.free) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.digest = [None] * self.num_blocks
        if self.emit:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
