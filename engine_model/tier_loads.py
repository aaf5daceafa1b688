"""The engine's side of the offload tiers (:mod:`engine_model.tiers`): L2 lookups on arrival, tier
hits at admission, their loads, and the stores at the end of each step (:class:`TierLoads`, mixed
into :class:`engine_model.engine.Engine`).

As vLLM 0.32 schedules them (``vllm/v1/core/sched/scheduler.py``):

* A fresh request first takes its GPU prefix hit; the offloading connector is then asked for
  more from the first block the GPU lacks (``scheduler.py:959-1046``,
  ``get_num_new_matched_tokens``): the L1's consecutive hits, then the L2's. An L2 lookup is
  asynchronous in vLLM (the request is skipped until it answers, ``scheduler.py:985-990``); here
  the L2 is asked once when the request arrives, and the request joins the waiting queue with
  the answer.
* A request with tier hits is admitted to *load* them (vLLM's ``load_kv_async``,
  ``scheduler.py:1320-1339``: state WAITING_FOR_REMOTE_KVS, the blocks allocated, counted in
  ``vllm:num_requests_kv_fetch_by_stage{stage="in_progress"}``). L2 hits are promoted into the
  L1 first (``vllm/v1/kv_offload/tiering/manager.py:489-540``): ``l2_load_time`` (CPU
  BlockStored events once there), then every loaded block is copied to the GPU:
  ``l1_load_time``. The loaded blocks are then cached in the GPU pool (GPU BlockStored, as
  ``_update_waiting_for_remote_kv``, ``scheduler.py:3123``, caches the loaded tokens) and the request waits to
  compute the rest of its prompt.
* Counting (``scheduler.py:1039-1042,1290-1316``; ``vllm/v1/metrics/loggers.py:1165-1190``): the GPU
  hit is ``vllm:prefix_cache_hits`` (and ``prompt_tokens_cached_by_source{source="device"}``);
  the loaded tokens are ``vllm:external_prefix_cache_hits`` out of
  ``vllm:external_prefix_cache_queries`` = prompt - GPU hit, split by tier in
  ``prompt_tokens_cached_by_source``: ``host`` for L1 blocks (``cpu/manager.py:197-201``),
  ``disk`` for promoted L2 blocks (a STORAGE tier's source, ``tiering/base.py:144-155``,
  kept per request by ``tiering/manager.py:527-530``). A request resumed after a preemption is
  kept out of them (``vllm/v1/metrics/stats.py:138-151``). Usage's
  ``prompt_tokens_details.cached_tokens`` is GPU hit + loaded tokens (``num_cached_tokens`` =
  local + external, ``vllm/v1/metrics/stats.py:307-319``), and the loaded tokens are
  ``prompt_tokens_by_source{source="external_kv_transfer"}``.
* Stores: every full block computed (or loaded from a peer) is offered to the L1 when its step
  ends; blocks new to the L1 cascade to the L2 (uploaded for ``l2_load_time``, then visible to
  every engine and announced with a STORAGE/REMOTE BlockStored).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from engine_model.config import SimConfig
from engine_model.metrics import SimMetrics
from engine_model.prefix import BlockPool, extend_digests
from engine_model.seq import DECODE, REMOTE_KV, WAITING, Seq, cdiv
from engine_model.tiers import TierBlock, Tiers, blocks_of
from policies.beliefs.blockhash import HashSpec

log = logging.getLogger("engine_model.engine")


class TierLoads:
    """Tier lookups, loads and stores on top of the scheduler's state."""

    cfg: SimConfig
    m: SimMetrics
    hash_spec: HashSpec | None
    pool: BlockPool
    tiers: Tiers | None
    probing: set[Seq]
    waiting: deque[Seq]
    ready_kv: deque[Seq]
    remote_kv: set[Seq]
    running: list[Seq]
    _wake: asyncio.Event
    _clock: Callable[[], float]

    # ------------------------------------------------------------------ the scheduler's side
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        raise NotImplementedError

    def _admit_blocks(self, seq: Seq, hits: list[int], n_tokens: int) -> bool:
        raise NotImplementedError

    def _record_admission(self, seq: Seq, local: int) -> None:
        raise NotImplementedError

    def _cache_blocks(self, seq: Seq, n_tokens: int) -> None:
        raise NotImplementedError

    def _publish_events(self) -> None:
        raise NotImplementedError

    def _lookup(self, seq: Seq) -> list[int]:
        raise NotImplementedError

    # ------------------------------------------------------------------ arrival
    def _max_hit_blocks(self, seq: Seq) -> int:
        """Full blocks a hit may cover: at most num_tokens - 1 tokens (the last one is computed)."""
        return (seq.num_tokens - 1) // self.cfg.block_size

    def _needs_l2_probe(self, seq: Seq) -> bool:
        tiers, spec = self.tiers, self.hash_spec
        if tiers is None or tiers.l2 is None or spec is None or seq.kind == DECODE:
            return False
        max_blocks = self._max_hit_blocks(seq)
        if max_blocks <= 0:
            return False
        extend_digests(seq.digests, seq.prompt_ids, max_blocks, spec, seq.hash_extra)
        gpu = len(self._lookup(seq))  # the GPU and the L1 already hold it all: no need to ask
        return gpu + tiers.l1.match(seq.digests, gpu, max_blocks) < max_blocks

    async def _probe_l2(self, seq: Seq) -> None:
        """Ask the L2 which of the request's blocks it holds, then let the request wait."""
        try:
            assert self.tiers is not None and self.tiers.l2 is not None
            max_blocks = self._max_hit_blocks(seq)
            seq.l2_present = await self.tiers.l2.probe(seq.digests[:max_blocks])
        finally:
            self.probing.discard(seq)
            if seq.state == WAITING:  # not aborted meanwhile
                self.waiting.append(seq)
                self._wake.set()

    # ------------------------------------------------------------------ admission
    def _tier_hits(self, seq: Seq, hits: list[int]) -> tuple[int, int]:
        """(L1 blocks, L2 blocks) a fresh request loads after its GPU hit ``hits``."""
        if self.tiers is None or seq.kind == DECODE:
            return 0, 0
        max_blocks = self._max_hit_blocks(seq)
        if len(hits) >= max_blocks:
            return 0, 0
        return self.tiers.match(seq.digests, len(hits), max_blocks, seq.l2_present)

    def _start_tier_load(self, seq: Seq, hits: list[int], n1: int, n2: int, now: float) -> bool:
        """Admit a request to load ``n1`` L1 blocks and ``n2`` L2 blocks after its GPU hit."""
        tiers = self.tiers
        assert tiers is not None
        bs = self.cfg.block_size
        local, ext = len(hits) * bs, (n1 + n2) * bs
        if not self._load_fits(seq, hits) or not self._admit_blocks(seq, hits, local + ext):
            return False
        seq.state = REMOTE_KV
        if seq.scheduled_t is None:
            seq.scheduled_t = now
        seq.num_computed = local
        self._record_admission(seq, local)
        if not seq.num_preemptions:
            m = self.m
            m.ext_prefix_queries.inc(seq.num_tokens - local)
            m.ext_prefix_hits.inc(ext)
            m.cached_by_source["host"].inc(n1 * bs)
            m.cached_by_source["disk"].inc(n2 * bs)
        tiers.stats["l1_hit_tokens"] += n1 * bs
        tiers.stats["l2_hit_tokens"] += n2 * bs
        first = len(hits)
        tiers.l1.pin(seq.digests[first : first + n1])
        self.remote_kv.add(seq)
        seq.pull_task = self._spawn(self._tier_load(seq, first, n1, n2))
        return True

    def _load_fits(self, seq: Seq, hits: list[int]) -> bool:
        """vLLM admits an async load only if its whole sequence fits in the free blocks less what
        the loads already in flight still need (``scheduler.py:1242-1251``,
        ``_inflight_prefill_reserved_blocks``, ``scheduler.py:3060-3092``; with
        ``scheduler_reserve_full_isl``, on by default): a load holds its blocks without progress, so
        loads that each hold part of the cache could otherwise wait on each other for ever."""
        bs, pool = self.cfg.block_size, self.pool
        reserved = sum(max(cdiv(s.num_tokens, bs) - len(s.blocks), 0) for s in (*self.remote_kv, *self.ready_kv))
        need = cdiv(seq.num_tokens, bs) - len(hits) + pool.evictable(hits)
        return need + reserved <= pool.num_free

    async def _tier_load(self, seq: Seq, first: int, n1: int, n2: int) -> None:
        """L2 -> L1 (promotion), then L1 -> GPU; the request then waits to compute the rest."""
        tiers = self.tiers
        assert tiers is not None
        cfg, bs = self.cfg, self.cfg.block_size
        l1_keys = seq.digests[first : first + n1]
        pinned = list(l1_keys)
        try:
            if n2:
                wait = cfg.l2_load_time(n2 * bs)
                if wait:
                    await asyncio.sleep(wait)
                tokens = seq.prompt_ids + seq.output_ids
                promoted = blocks_of(seq.digests, first + n1, first + n1 + n2, tokens, bs)
                keys = [b.digest for b in promoted]
                if tiers.l2 is not None:
                    self._spawn(tiers.l2.touch(keys))
                tiers.store_l1(promoted)  # CPU BlockStored (and the evictions it takes)
                tiers.l1.pin(keys)
                pinned += keys
                self._publish_if_idle()  # the promotion precedes the GPU copy, as vLLM's steps order them
            wait = cfg.l1_load_time((n1 + n2) * bs)
            if wait:
                await asyncio.sleep(wait)
            n_tokens = (first + n1 + n2) * bs
            seq.external_tokens = (n1 + n2) * bs
            self._cache_blocks(seq, n_tokens)  # GPU BlockStored for the loaded blocks
            seq.num_computed = n_tokens
            self.remote_kv.discard(seq)
            seq.state = WAITING
            self.ready_kv.append(seq)
            self._wake.set()
        finally:
            tiers.l1.unpin(pinned)
            tiers.l1.touch(pinned)

    # ------------------------------------------------------------------ stores
    def _offer_blocks(self, seq: Seq, start: int, end: int, tokens: list[int]) -> None:
        """Blocks ``start..end`` of ``seq`` are being computed: offload them when the step ends."""
        if self.tiers is not None and end > start:
            self.tiers.offer(blocks_of(seq.digests, start, end, tokens, self.cfg.block_size))

    def _commit_tiers(self) -> None:
        """The step ran: its computed blocks go to the L1, the new ones on to the L2."""
        tiers = self.tiers
        if tiers is None:
            return
        new = tiers.commit()
        if new and tiers.l2 is not None:
            self._spawn(self._upload(new))

    async def _upload(self, blocks: list[TierBlock]) -> None:
        tiers = self.tiers
        assert tiers is not None and tiers.l2 is not None
        wait = self.cfg.l2_load_time(len(blocks) * self.cfg.block_size)
        if wait:
            await asyncio.sleep(wait)
        if await tiers.l2.put([b.digest for b in blocks]):
            tiers.stored_l2(blocks)
            self._publish_if_idle()

    def _publish_if_idle(self) -> None:
        """Tier events that arrive between steps go out at once when no step is coming to carry them."""
        if not (self.running or self.waiting or self.ready_kv):
            self._publish_events()

    def tier_state(self) -> dict[str, Any] | None:
        """The tiers' part of /sim/state (the L2's size is asked by the caller)."""
        if self.tiers is None:
            return None
        snap = self.tiers.snapshot()
        if self.tiers.l2 is not None:
            snap["l2"] = self.tiers.l2.describe()
        return snap
