"""The simulated engine core: scheduler loop, KV block accounting, latency model, P/D legs.

Model (a small cousin of vLLM's v1 scheduler):

* Every request choice is one :class:`Seq` (one engine request). Its tokens are the prompt
  plus what it has generated; ``num_computed`` counts tokens whose KV exists.
* One asyncio task runs *steps*. A step schedules the running seqs (each computes what it
  is missing: its prompt chunk while prefilling, one token while decoding) and admits
  waiting seqs while there is a free slot (``max_num_seqs``), token budget
  (``max_num_batched_tokens``) and free KV blocks: vLLM's continuous batching with chunked
  prefill (running seqs first, then new ones; a prompt longer than the budget is prefilled
  in chunks over several steps). A step lasts (:meth:`SimConfig.step_time`)
  ``step_base_time + prefill_tokens * prefill_time_per_token + pairs * prefill_attention_time``
  (pairs: each prefill chunk's ``chunk * (prefix + chunk / 2)``, its attention over what is already
  computed and itself) plus, when any seq decodes, ``decode_time_per_token + decode_seqs *
  decode_time_per_seq + context * context_time_per_token`` (context: the KV tokens the decoding
  seqs attend to), times ``time_scale``. So a long
  prefill chunk stalls every decoding stream in the same engine (the interference that P/D
  disaggregation removes). A seq that has computed all its tokens samples one. Profiles
  (``engine_model/profiles/*.yaml``, :mod:`engine_model.profiles`) set these from a model and GPU shape.
* KV blocks are ``block_size`` tokens; block 0 is vLLM's null block, so
  ``kv_cache_usage_perc = 1 - free / (num_gpu_blocks - 1)``. A running seq that cannot
  grow preempts the newest running seq (recompute, counted in vllm:num_preemptions).
* Prefix caching (:mod:`engine_model.prefix`, on by default as in vLLM 0.32): full blocks are
  registered under their chained hashes when scheduled; a seq admitted with nothing computed
  reuses its longest cached prefix (at most ``num_tokens - 1`` tokens), which it neither
  prefills nor pays step time for. Freed cached blocks stay reusable until evicted (LRU).
  Each step's cache changes go out as one KV event batch (:mod:`engine_model.kv_events`).
* The P/D legs (a prefill leg's held blocks, a decode leg's KV pull, their failures and
  heartbeats) are :mod:`engine_model.kv_transfer`, mixed into :class:`Engine`; the offload tiers
  (an L1 in host memory, a shared L2: :mod:`engine_model.tiers`) are
  :mod:`engine_model.tier_loads`, mixed in too, as are LoRA adapters (:mod:`engine_model.adapters`:
  the adapter cache and its load time, the ``max_loras`` cap); the request types are
  :mod:`engine_model.seq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_model.adapters import LoRAScheduling, LoRASlots
from engine_model.config import SimConfig, attention_pairs
from engine_model.faults import Faults
from engine_model.kv import KVClient
from engine_model.kv_events import EventSink
from engine_model.kv_transfer import KVTransfer
from engine_model.metrics import SimMetrics
from engine_model.prefix import BlockPool, engine_hash_spec, extend_digests
from engine_model.seq import DECODE, FINISHED, PREFILL, REMOTE_KV, RUNNING, WAITING, Held, Seq, cdiv
from engine_model.tier_loads import TierLoads
from engine_model.tiers import L2Store, Tiers
from engine_model.tokens import OutputVocab

log = logging.getLogger("engine_model.engine")


@dataclass
class _Step:
    """One scheduler step being put together: what runs, and the token budget left."""

    budget: int
    loras: LoRASlots | None = None  # the adapters scheduled so far (with --enable-lora)
    batch: list[tuple[Seq, int]] = field(default_factory=list)
    prefill_tokens: int = 0

    def add(self, seq: Seq, chunk: int, prefill: bool) -> None:
        self.batch.append((seq, chunk))
        if self.loras is not None:
            self.loras.add(seq.lora)
        self.budget -= chunk
        if prefill:
            self.prefill_tokens += chunk


class Engine(KVTransfer, TierLoads, LoRAScheduling):
    """One simulated engine: its queues, its blocks and the step loop that runs them."""

    def __init__(
        self,
        cfg: SimConfig,
        metrics: SimMetrics,
        vocab: OutputVocab,
        kv_client: KVClient | None = None,
        publisher: EventSink | None = None,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        l2: L2Store | None = None,
    ) -> None:
        """``clock``: what timestamps requests (a fleet on a virtual clock passes its loop's).
        ``l2``: the shared L2 store (with ``cfg.cpu_blocks``); the engine closes it on stop."""
        self.cfg = cfg
        self._clock = clock
        self.faults = faults
        self.m = metrics
        self.vocab = vocab
        self.kv = kv_client or KVClient(connect_timeout=cfg.kv_handshake_timeout)
        self.kv_port = 0  # set once the side channel listens
        self.publisher = publisher
        self.hash_spec = (
            engine_hash_spec(cfg.block_size, cfg.prefix_caching_hash_algo) if cfg.enable_prefix_caching else None
        )
        self.pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, self.hash_spec, events=publisher is not None)
        self.total_blocks = cfg.num_gpu_blocks - 1
        self.tiers: Tiers | None = None
        if cfg.cpu_blocks and self.hash_spec is not None:
            self.tiers = Tiers(cfg.cpu_blocks, self.hash_spec, publisher is not None, cfg.self_describing_kv_events, l2)
        self.probing: set[Seq] = set()  # arrived, their L2 lookup not answered yet
        # What each block holds: (seq whose KV it is, its index in that seq, tokens computed).
        # Like real KV memory it keeps its content after release, until reallocated.
        self.block_src: list[tuple[Seq, int, int] | None] = [None] * cfg.num_gpu_blocks
        self.waiting: deque[Seq] = deque()
        self.ready_kv: deque[Seq] = deque()
        self.remote_kv: set[Seq] = set()
        self.running: list[Seq] = []
        self.held: dict[str, Held] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[None]] = set()
        self._init_loras()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(), name="sim-engine-loop"),
            asyncio.create_task(self._heartbeat_loop(), name="sim-kv-heartbeats"),
        ]

    async def stop(self) -> None:
        for t in self._tasks + list(self._bg):
            t.cancel()
        for t in self._tasks + list(self._bg):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for h in self.held.values():
            if h.timer:
                h.timer.cancel()
        await self.kv.close()
        if self.tiers is not None and self.tiers.l2 is not None:
            await self.tiers.l2.close()

    # ------------------------------------------------------------------ state
    def kv_usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block (AllBlocksCleared). Refused
        while blocks are in use (running requests, held prefill blocks, KV loads); with
        ``reset_running_requests`` the running requests are preempted first; with
        ``reset_connector`` (``?reset_external=true``) the L1 is emptied too (the L2 persists)."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running[-1])
        ok = self.pool.reset()
        if ok and reset_connector and self.tiers is not None:
            self.tiers.reset()
        if ok:
            log.info("Successfully reset prefix cache")
        else:
            log.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.total_blocks - self.pool.num_free,
            )
        self._publish_events()  # vLLM publishes with its next engine step; nothing to wait for here
        self._wake.set()
        return ok

    def _publish_events(self) -> None:
        """One batch: the GPU pool's events, then the tiers' (vLLM's order, scheduler.py:2370-2385)."""
        if self.publisher is None:
            return
        events = self.pool.take_events() if self.pool.events else []
        if self.tiers is not None and self.tiers.events:
            events.extend(self.tiers.take_events())
        if events:
            self.publisher.publish(events)

    def update_gauges(self) -> None:
        m = self.m
        skipped = len(self.lora_deferred)  # vLLM counts skipped requests as deferred
        capacity = len(self.waiting) + len(self.ready_kv) - skipped
        deferred = len(self.remote_kv) + len(self.probing) + skipped
        m.running.set(len(self.running))
        m.waiting.set(capacity + deferred)
        m.waiting_capacity.set(capacity)
        m.waiting_deferred.set(deferred)
        m.kv_fetch["waiting_to_start"].set(sum(1 for s in self.waiting if s.kind == DECODE and not s.kv_pulled))
        m.kv_fetch["in_progress"].set(deferred)
        m.kv_fetch["completed_waiting"].set(len(self.ready_kv))
        m.kv_usage.set(self.kv_usage())

    # ------------------------------------------------------------------ requests
    def submit(self, seq: Seq) -> None:
        if self._needs_l2_probe(seq):
            self.probing.add(seq)
            self._spawn(self._probe_l2(seq))
            return
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """Client went away: drop the seq now and give its blocks back."""
        if seq.state == FINISHED:
            return
        state = seq.state
        if state == WAITING:
            self.probing.discard(seq)
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
            with contextlib.suppress(ValueError):
                self.ready_kv.remove(seq)
        elif state == RUNNING:
            with contextlib.suppress(ValueError):
                self.running.remove(seq)
        elif state == REMOTE_KV:
            self.remote_kv.discard(seq)
            if seq.pull_task is not None:
                seq.pull_task.cancel()  # its finally-clause notifies the prefill engine
        self._free(seq)
        self._lora_done(seq)
        seq.state = FINISHED
        seq.finish_reason = "abort"
        seq.finished_t = self._clock()
        if seq.kind == DECODE and not seq.kv_pulled and state == WAITING:
            # Never scheduled: tell the prefill engine to drop its blocks (vLLM sends a
            # notification with no read for requests aborted before their transfer).
            self._release_remote(seq)
        self._done(seq)
        self._wake.set()

    def _done(self, seq: Seq) -> None:
        c = seq.collector
        if c is not None:
            c.pending -= 1
            c.event.set()
            if c.pending <= 0 and not c.done.done():
                c.done.set_result(None)

    # ------------------------------------------------------------------ blocks
    def _grow(self, seq: Seq, n_tokens: int) -> bool:
        need = cdiv(n_tokens, self.cfg.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        src = self.block_src
        for b in new:
            src[b] = None  # about to be overwritten
        seq.blocks.extend(new)
        return True

    def _lookup(self, seq: Seq) -> list[int]:
        """Blocks of ``seq``'s longest cached prefix (at most num_tokens - 1 tokens: the last
        one is always computed, to sample from)."""
        spec = self.hash_spec
        if spec is None:
            return []
        max_blocks = (seq.num_tokens - 1) // spec.block_size
        if max_blocks <= 0:
            return []
        if len(seq.digests) < max_blocks:
            extend_digests(seq.digests, seq.prompt_ids + seq.output_ids, max_blocks, spec, seq.hash_extra)
        return self.pool.lookup(seq.digests, max_blocks)

    def _admit_blocks(self, seq: Seq, hits: list[int], n_tokens: int) -> bool:
        """Give a newly admitted seq its cache hits plus new blocks up to ``n_tokens``, or
        nothing if they do not all fit (hits sitting in the free queue count against it)."""
        pool = self.pool
        need = cdiv(n_tokens, self.cfg.block_size) - len(hits)
        if need + pool.evictable(hits) > pool.num_free:
            return False
        pool.touch(hits)
        seq.blocks = list(hits)
        seq.num_cached_blocks = len(hits)
        if not self._grow(seq, n_tokens):  # pragma: no cover - checked above
            raise AssertionError("block accounting is off")
        return True

    def _cache_blocks(self, seq: Seq, n_tokens: int) -> None:
        """Register the seq's full blocks up to ``n_tokens`` in the prefix cache (vLLM does it
        when it schedules the tokens, so the step's BlockStored events cover them)."""
        spec = self.hash_spec
        if spec is None:
            return
        full = min(n_tokens, seq.num_tokens) // spec.block_size
        done = seq.num_cached_blocks
        if full <= done:
            return
        tokens = seq.prompt_ids + seq.output_ids if seq.output_ids else seq.prompt_ids
        extend_digests(seq.digests, tokens, full, spec, seq.hash_extra)
        self.pool.cache(seq.blocks, seq.digests, done, full, tokens, seq.lora)
        self._offer_blocks(seq, done, full, tokens)
        seq.num_cached_blocks = full

    def _record_admission(self, seq: Seq, local: int) -> None:
        """Prefix-cache stats at a fresh admission. vLLM keeps requests resumed after a
        preemption out of the exported counters; their first admission's split holds."""
        if seq.num_preemptions:
            return
        m = self.m
        seq.local_hit = local
        if self.hash_spec is not None:
            m.prefix_queries.inc(seq.num_tokens)
            m.prefix_hits.inc(local)
            m.cached_by_source["device"].inc(local)

    def _free(self, seq: Seq) -> None:
        if seq.blocks:
            self._record_content(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        seq.num_cached_blocks = 0

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.in_prefill = True
        seq.state = WAITING
        seq.num_preemptions += 1
        self.m.preemptions.inc()
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ the step loop
    async def _loop(self) -> None:
        while True:
            if self._lora_calls:
                await self._run_lora_calls()  # add_lora utility calls, between steps
            if not (self.running or self.waiting or self.ready_kv):
                await self._idle()
                continue
            now = self._clock()
            step = _Step(self.cfg.max_num_batched_tokens, self.lora_slots())
            self._schedule_running(step)
            self._admit_waiting(step, now)
            if not step.batch:
                # Nothing can run (no blocks, or only KV loads in flight): wait for a change.
                await self._idle()
                continue
            await asyncio.sleep(self._step_time(step) + self._apply_adapters(step.batch))
            self._complete(step)

    async def _idle(self) -> None:
        self._publish_events()
        self._wake.clear()
        await self._wake.wait()

    def _schedule_running(self, step: _Step) -> None:
        """The running seqs first: each computes what it is missing, preempting the newest
        running seq while its blocks cannot grow."""
        for seq in list(self.running):
            if seq.state != RUNNING:
                continue  # preempted by an earlier seq of this step
            if step.budget <= 0:
                break
            chunk = min(seq.num_tokens - seq.num_computed, step.budget)
            while not self._grow(seq, seq.num_computed + chunk):
                self._preempt(self.running[-1])
                if seq.state != RUNNING:
                    break
            if seq.state != RUNNING:
                continue
            self._cache_blocks(seq, seq.num_computed + chunk)
            step.add(seq, chunk, seq.in_prefill)

    def _admit_waiting(self, step: _Step, now: float) -> None:
        """Then waiting seqs (those whose KV arrived first) while a slot, budget and blocks last.
        A seq whose adapter would exceed ``max_loras`` is skipped and keeps its place (vLLM)."""
        skipped: tuple[list[Seq], list[Seq]] = ([], [])
        while step.budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            queue = self.ready_kv or self.waiting
            if not queue:
                break
            seq = queue[0]
            if step.loras is not None and not step.loras.fits(seq.lora):
                skipped[queue is self.waiting].append(queue.popleft())
                self.lora_deferred.add(seq)
                continue
            fresh = seq.num_computed == 0  # vLLM looks the prefix cache up for these
            hits = self._lookup(seq) if fresh else []
            n1, n2 = self._tier_hits(seq, hits) if fresh else (0, 0)
            if seq.kind == DECODE and not seq.kv_pulled:
                admitted = self._start_pull(seq, hits, now)
            elif n1 or n2:
                admitted = self._start_tier_load(seq, hits, n1, n2, now)
            else:
                admitted = self._admit(seq, hits, fresh, step, now)
            if not admitted:
                break
            queue.popleft()
            self.lora_deferred.discard(seq)
        self.ready_kv.extendleft(reversed(skipped[0]))
        self.waiting.extendleft(reversed(skipped[1]))

    def _start_pull(self, seq: Seq, hits: list[int], now: float) -> bool:
        """Admit a decode leg: local hits first; the rest of the prompt is loaded from the
        prefill engine."""
        m = self.m
        local = len(hits) * self.cfg.block_size
        if not self._admit_blocks(seq, hits, seq.prompt_len):
            return False
        seq.state = REMOTE_KV
        seq.scheduled_t = now
        seq.num_computed = local
        self._record_admission(seq, local)
        ext = seq.prompt_len - local
        # vLLM counts the connector's hit when it schedules the load, not after it.
        m.ext_prefix_queries.inc(ext)
        m.ext_prefix_hits.inc(ext)
        m.cached_by_source["p2p"].inc(ext)
        self.remote_kv.add(seq)
        seq.pull_task = self._spawn(self._pull(seq, len(hits)))
        return True

    def _admit(self, seq: Seq, hits: list[int], fresh: bool, step: _Step, now: float) -> bool:
        """Admit a seq to run its first (or next, after a preemption) prompt chunk."""
        local = len(hits) * self.cfg.block_size
        chunk = min(seq.num_tokens - max(seq.num_computed, local), step.budget)
        if fresh:
            if not self._admit_blocks(seq, hits, local + chunk):
                return False
            seq.num_computed = local
        elif not self._grow(seq, seq.num_computed + chunk):
            return False
        seq.state = RUNNING
        if fresh:
            self._record_admission(seq, local)
        if seq.scheduled_t is None:
            seq.scheduled_t = now
            self.m.ext_prefix_queries.inc(seq.num_tokens - local)
        self._cache_blocks(seq, seq.num_computed + chunk)
        self.running.append(seq)
        step.add(seq, chunk, prefill=True)
        return True

    def _step_time(self, step: _Step) -> float:
        cfg = self.cfg
        decode_seqs = context = 0
        pairs = 0.0
        for seq, chunk in step.batch:
            if not seq.in_prefill:
                decode_seqs += 1
                context += seq.num_computed + chunk
            elif cfg.prefill_attention_time:
                pairs += attention_pairs(chunk, seq.num_computed)
        return cfg.step_time(step.prefill_tokens, decode_seqs, context, pairs)

    def _complete(self, step: _Step) -> None:
        """The step ran: count what each seq computed and sample where a seq is up to date."""
        now = self._clock()
        generated = 0
        for seq, chunk in step.batch:
            if seq.state != RUNNING:
                continue  # aborted during the step
            seq.num_computed += chunk
            if seq.num_computed >= seq.num_tokens:
                self._sample(seq, now)
                generated += 1
        self.m.iteration_tokens.observe(step.prefill_tokens + generated)
        self._record_lora_info()
        self._commit_tiers()
        self._publish_events()  # one KVEventBatch per step, as vLLM's scheduler does

    # ------------------------------------------------------------------ tokens
    def _sample(self, seq: Seq, now: float) -> None:
        m = self.m
        k = len(seq.output_ids)
        idx = seq.context.choice() % self.vocab.size
        tid = self.vocab.ids[idx]
        seq.context.append(tid)
        seq.output_ids.append(tid)
        seq.pieces.append(self.vocab.pieces[idx])
        if seq.first_token_t is None:
            seq.first_token_t = now
            m.ttft.observe(now - seq.arrival)
            self._lora_output(seq)
        else:
            # The call that set first_token_t also set last_token_t (end of this method).
            assert seq.last_token_t is not None
            m.itl.observe(now - seq.last_token_t)
        if not seq.counted_prompt:
            seq.counted_prompt = True
            ext, local = seq.external_tokens, seq.local_hit
            cached = ext + local
            m.prompt_tokens.inc(seq.prompt_len)
            m.prompt_by_source["local_compute"].inc(seq.prompt_len - cached)
            m.prompt_by_source["local_cache_hit"].inc(local)
            m.prompt_by_source["external_kv_transfer"].inc(ext)
            m.prompt_cached.inc(cached)
            # Usage details: a decode leg reports the prefill engine's hits (vLLM 0.32 passes
            # them in kv_transfer_params.remote_prefill_cached_tokens), else its own.
            remote = (seq.kv_in or {}).get("remote_prefill_cached_tokens") if seq.kind == DECODE else None
            seq.cached_tokens = remote if type(remote) is int else cached
            in_cache = min(seq.num_cached_blocks * self.cfg.block_size, seq.prompt_len)
            seq.created_cache_tokens = max(0, in_cache - cached)
        seq.last_token_t = now
        seq.in_prefill = False
        m.generation_tokens.inc()

        n_out = k + 1
        reason: str | None = None
        if n_out > seq.min_tokens:
            if tid in seq.stop_token_ids:
                reason, seq.stop_reason = "stop", tid
            elif seq.stop_strs:
                text = "".join(seq.pieces)
                tail_from = max(0, len(text) - len(seq.pieces[-1]) - max(map(len, seq.stop_strs)))
                for s in seq.stop_strs:
                    if s and text.find(s, tail_from) >= 0:
                        reason, seq.stop_reason = "stop", s
                        break
        if reason is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.cfg.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, now)
        elif seq.collector is not None:
            seq.collector.event.set()

    def _finish(self, seq: Seq, reason: str, now: float) -> None:
        m = self.m
        if seq.state == RUNNING:
            self.running.remove(seq)
        elif seq.state == REMOTE_KV:
            self.remote_kv.discard(seq)
        seq.state = FINISHED
        seq.finish_reason = reason
        seq.finished_t = now
        self._lora_done(seq)
        if seq.kind == PREFILL and reason in ("length", "stop") and seq.blocks:
            self._hold(seq)
        else:
            self._free(seq)
        m.success[reason].inc()
        m.e2e.observe(now - seq.arrival)
        sched = seq.scheduled_t if seq.scheduled_t is not None else now
        m.queue_time.observe(sched - seq.arrival)
        first = seq.first_token_t if seq.first_token_t is not None else now
        last = seq.last_token_t if seq.last_token_t is not None else now
        m.prefill_time.observe(first - sched)
        m.inference_time.observe(last - sched)
        m.decode_time.observe(last - first)
        n_out = len(seq.output_ids)
        m.tpot.observe((last - first) / (n_out - 1) if n_out > 1 else 0.0)
        m.req_prompt_tokens.observe(seq.prompt_len)
        m.req_generation_tokens.observe(n_out)
        m.req_preemptions.observe(seq.num_preemptions)
        m.prefill_kv_computed.observe(seq.prompt_len - seq.external_tokens - seq.local_hit)
        m.req_max_gen_tokens.observe(n_out)
        m.req_params_n.observe(seq.n_param)
        m.req_params_max_tokens.observe(seq.max_tokens)
        self._done(seq)
        self._wake.set()
