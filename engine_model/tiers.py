"""KV offload tiers behind the GPU prefix cache, as vLLM 0.32's offloading connector runs them.

* **L1** (:class:`CpuTier`, ``--cpu-blocks N``): the engine's host-memory tier, vLLM's native CPU
  offloading (``vllm/v1/kv_offload/cpu/manager.py``) with its LRU policy
  (``vllm/v1/kv_offload/cpu/policies/lru.py``). Blocks are stored *when they are computed*, not when
  the GPU evicts them: the connector builds store jobs for every newly computed full block of each
  scheduled request (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:1570-1620``,
  ``_build_store_jobs``). A store that needs room evicts the least recently used unpinned blocks,
  never one of the blocks offered (``cpu/manager.py:311-343``); when too few are evictable the
  store is skipped (``cpu/manager.py:315-326``). A use makes a block most recent; a request's
  blocks are ranked with its first block most recent, so a prefix's head outlives its tail
  (``lru.py:91-104``: recency is assigned over the keys reversed).
* **L2** (:class:`InProcessL2`, or :class:`engine_model.l2_redis.RedisL2` for ``--l2-url``): a store
  of block hashes shared by engines, a secondary tier behind the L1 like vLLM's object-store tier
  (``vllm/v1/kv_offload/tiering/obj/manager.py``). Blocks newly stored in the L1 cascade to it
  (``vllm/v1/kv_offload/tiering/manager.py:736-773``, ``complete_store``); an L2 hit is first
  promoted into the L1, then loaded to the GPU like an L1 hit (``tiering/manager.py:489-540``,
  ``tiering/base.py:135-137``).

Events (published with the engine's other KV events; vLLM merges the connector's after the GPU
pool's, ``vllm/v1/core/sched/scheduler.py:2370-2385``):

* L1: ``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"`` and no locality: the CPU manager's
  ``OffloadingEvent`` leaves ``locality`` at None (``cpu/manager.py:336-343,390-397``,
  ``vllm/v1/kv_offload/base.py:166-174``). A promoted L2 block is an L1 store too (the primary
  tier's ``complete_store``), with no cascade back.
* L2: ``BlockStored`` with ``medium="STORAGE"`` and ``locality="REMOTE"`` once the upload succeeded
  (``tiering/obj/manager.py:104,139,379-389``: the tier's medium is STORAGE, its locality is the
  one configured, ``REMOTE`` for a network store per ``tiering/backpressure.py:187-195``). The
  object tier never publishes removals, so nor does this L2 (an evicted L2 block just stops
  hitting).
* Payload: by default vLLM's placeholder (``offloading/events.py:337-357``, ``_placeholder_stored``):
  one event per block with its hash, ``parent_block_hash=None``, ``token_ids=[]``,
  ``block_size=0``. With ``self_describing_kv_events`` the full payload of each block
  (``offloading/events.py:359-405``): its tokens, parent hash, block size and
  ``kv_cache_spec_kind="full_attention"``. Removals carry the hashes of one batch in one event
  (``offloading/events.py:407-441``). An offload chunk is one block (vLLM's default
  ``blocks_per_chunk = 1``, ``offloading/config.py:98``), so the hash is the GPU block's.

Costs: the GPU->host store overlaps the step (vLLM copies on its own stream), so it is free here;
a load holds the request in the KV-loading state for ``l2_load_time`` (L2 hits) and then
``l1_load_time`` (every loaded block), :mod:`engine_model.tier_loads`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_model.kv_events import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from policies.beliefs.blockhash import Digest, HashSpec


@dataclass(frozen=True)
class TierBlock:
    """One full block offered to a tier: its hash, its parent's, and its tokens."""

    digest: Digest
    parent: Digest | None
    tokens: tuple[int, ...]


def blocks_of(digests: Sequence[Digest], start: int, end: int, tokens: Sequence[int], bs: int) -> list[TierBlock]:
    """Blocks ``start..end`` of a request (``digests``: its chained block hashes)."""
    return [
        TierBlock(digests[i], digests[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))
        for i in range(start, end)
    ]


class CpuTier:
    """The L1: an LRU of ``capacity`` block hashes; pinned blocks (being loaded) are not evictable."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[Digest, None] = OrderedDict()  # first: least recently used
        self.pins: dict[Digest, int] = {}

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, d: Digest) -> bool:
        return d in self.lru

    def match(self, digests: Sequence[Digest], start: int, stop: int) -> int:
        """How many of ``digests[start:stop]`` the L1 holds, consecutively from ``start``."""
        n = 0
        for d in digests[start:stop]:
            if d not in self.lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[Digest]) -> None:
        """Make ``keys`` most recently used, the first one most recent (``lru.py:91-93``)."""
        lru = self.lru
        for d in reversed(keys):
            if d in lru:
                lru.move_to_end(d)

    def pin(self, keys: Sequence[Digest]) -> None:
        for d in keys:
            self.pins[d] = self.pins.get(d, 0) + 1

    def unpin(self, keys: Sequence[Digest]) -> None:
        for d in keys:
            n = self.pins.get(d, 0) - 1
            if n > 0:
                self.pins[d] = n
            else:
                self.pins.pop(d, None)

    def evictable(self) -> int:
        return len(self.lru) - sum(1 for d in self.pins if d in self.lru)

    def room(self) -> int:
        """Blocks a store could place now (free ones plus evictable ones)."""
        return self.capacity - len(self.lru) + self.evictable()

    def store(self, keys: Sequence[Digest]) -> tuple[list[Digest], list[Digest]] | None:
        """Insert the keys not held yet, evicting LRU blocks for room (never one of ``keys``, nor
        a pinned one). Returns (stored, evicted), or None when there is not room for all of
        them (``cpu/manager.py:311-326``: the whole store is skipped). Held keys are touched."""
        lru = self.lru
        new = list(dict.fromkeys(d for d in keys if d not in lru))
        self.touch([d for d in keys if d in lru])
        need = len(new) - (self.capacity - len(lru))
        evicted: list[Digest] = []
        if need > 0:
            protected = set(keys)
            for d in lru:
                if len(evicted) == need:
                    break
                if d not in self.pins and d not in protected:
                    evicted.append(d)
            if len(evicted) < need:
                return None
            for d in evicted:
                del lru[d]
        for d in reversed(new):  # the first block most recent, as a request's keys are ranked
            lru[d] = None
        return new, evicted

    def clear(self) -> None:
        self.lru.clear()


class L2Store(Protocol):
    """A block-hash store shared by engines (Redis, or :class:`InProcessL2` in one process).
    Calls never raise: an unreachable store answers as an empty one."""

    capacity: int

    async def probe(self, keys: Sequence[Digest]) -> list[bool]: ...

    async def put(self, keys: Sequence[Digest]) -> bool: ...

    async def touch(self, keys: Sequence[Digest]) -> None: ...

    async def size(self) -> int | None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class InProcessL2:
    """An L2 shared by the engines of one process (the fleet in virtual time, tests): an LRU of
    ``capacity`` hashes with the first key of a call most recent, as :class:`RedisL2` ranks them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[Digest, None] = OrderedDict()

    async def probe(self, keys: Sequence[Digest]) -> list[bool]:
        return [d in self.lru for d in keys]

    async def put(self, keys: Sequence[Digest]) -> bool:
        lru = self.lru
        for d in reversed(keys):
            lru[d] = None
            lru.move_to_end(d)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
        return True

    async def touch(self, keys: Sequence[Digest]) -> None:
        for d in reversed(keys):
            if d in self.lru:
                self.lru.move_to_end(d)

    async def size(self) -> int | None:
        return len(self.lru)

    async def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"store": "in-process", "capacity": self.capacity}


class Tiers:
    """One engine's tiers: its L1, the shared L2 (if any), the stores waiting for the end of the
    step, the events to publish and what they served."""

    def __init__(
        self, cpu_blocks: int, spec: HashSpec, emit: bool, self_describing: bool, l2: L2Store | None = None
    ) -> None:
        self.l1 = CpuTier(cpu_blocks)
        self.l2 = l2
        self.spec = spec
        self.bs = spec.block_size
        self.emit = emit
        self.self_describing = self_describing
        self.events: list[KVCacheEvent] = []
        self.offers: list[TierBlock] = []
        self.stats = {"l1_hit_tokens": 0, "l2_hit_tokens": 0, "l1_stored": 0, "l1_evicted": 0, "l2_stored": 0}

    # ---------------------------------------------------------------- lookups
    def match(
        self, digests: Sequence[Digest], start: int, stop: int, l2_present: Sequence[bool] | None
    ) -> tuple[int, int]:
        """Blocks of ``digests[start:stop]`` the tiers serve, consecutively from ``start``: (from
        the L1, then from the L2 after those). ``l2_present``: the L2's answer for each of the
        request's blocks, asked when it arrived. L2 hits are limited to what the L1 can take in."""
        n1 = self.l1.match(digests, start, stop)
        n2 = 0
        if self.l2 is not None and l2_present is not None:
            for i in range(start + n1, min(stop, len(l2_present))):
                if not l2_present[i] or digests[i] in self.l1:
                    break
                n2 += 1
            n2 = min(n2, max(self.l1.room() - n1, 0))
        return n1, n2

    # ---------------------------------------------------------------- stores
    def offer(self, blocks: list[TierBlock]) -> None:
        """Blocks scheduled for compute this step: stored in the L1 when the step ends."""
        self.offers.extend(blocks)

    def commit(self) -> list[TierBlock]:
        """Store the step's computed blocks in the L1; returns those newly stored (they cascade to
        the L2)."""
        offers, self.offers = self.offers, []
        if not offers:
            return []
        return self.store_l1(offers)

    def store_l1(self, blocks: list[TierBlock]) -> list[TierBlock]:
        """Store ``blocks`` in the L1 (events: the evictions, then one store per new block)."""
        result = self.l1.store([b.digest for b in blocks])
        if result is None:
            return []
        new, evicted = result
        if evicted:
            self.stats["l1_evicted"] += len(evicted)
            if self.emit:
                self.events.append(self._removed(evicted, MEDIUM_CPU))
        fresh = set(new)
        stored = [b for b in blocks if b.digest in fresh]
        self.stats["l1_stored"] += len(stored)
        if self.emit:
            self.events.extend(self._stored(b, MEDIUM_CPU, None) for b in stored)
        return stored

    def stored_l2(self, blocks: list[TierBlock]) -> None:
        """The L2 upload of ``blocks`` succeeded: STORAGE/REMOTE events from this engine."""
        self.stats["l2_stored"] += len(blocks)
        if self.emit:
            self.events.extend(self._stored(b, MEDIUM_STORAGE, LOCALITY_REMOTE) for b in blocks)

    def reset(self) -> None:
        """vLLM's connector reset (``reset_prefix_cache?reset_external=true``): the L1 forgets
        everything without events (``cpu/manager.py:428-441``); the L2 persists
        (``tiering/manager.py:934-948``)."""
        self.l1.clear()
        self.offers.clear()

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    # ---------------------------------------------------------------- event payloads
    def _stored(self, b: TierBlock, medium: str, locality: str | None) -> BlockStored:
        ext = self.spec.external
        if not self.self_describing:
            return BlockStored(
                block_hashes=[ext(b.digest)],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=0,
                locality=locality,
            )
        return BlockStored(
            block_hashes=[ext(b.digest)],
            parent_block_hash=ext(b.parent) if b.parent is not None else None,
            token_ids=list(b.tokens),
            block_size=self.bs,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            locality=locality,
        )

    def _removed(self, digests: list[Digest], medium: str) -> BlockRemoved:
        ext = self.spec.external
        return BlockRemoved(block_hashes=[ext(d) for d in digests], medium=medium, group_idx=0)

    def snapshot(self) -> dict[str, Any]:
        l1 = self.l1
        return {
            "l1": {"blocks": len(l1), "capacity": l1.capacity, "pinned": len(l1.pins)},
            **self.stats,
        }
