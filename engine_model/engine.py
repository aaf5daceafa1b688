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
* Prefill leg (``kv_transfer_params.do_remote_decode``): runs like any request, then its
  blocks are *held* under its internal request id instead of freed, and the response
  carries the handle. Held blocks are released when a decode engine notifies (after
  pulling, or when it drops the request) or after ``kv_expiry`` seconds
  (vllm:nixl_num_kv_expired_reqs); decode engines waiting to run extend the lease
  with heartbeats.
* Decode leg (``do_remote_prefill``): once admitted it takes its local prefix hit, allocates
  blocks for the rest of its prompt and pulls only those blocks' KV over the side channel
  (:mod:`engine_model.kv`): a read, the transfer time (``kv_transfer_latency`` + per block
  ``kv_transfer_time_per_block`` + per token ``kv_transfer_time_per_token`` +
  ``kv_bytes_per_token`` over ``kv_bandwidth_gbps``), then a
  notify that frees the remote blocks.
  The pulled tokens count as ``external_kv_transfer``; the pulled full blocks enter the local
  prefix cache (as vLLM caches them once loaded); it recomputes the last prompt token and decodes.
* Failures, as in vLLM 0.32 (``kv_load_failure_policy=fail``): a side channel that does not
  answer within ``kv_handshake_timeout`` (vLLM: its 5 s ZMQ receive timeout), an answering
  engine that is not ``remote_engine_id``, or block ids outside the remote pool finish the
  decode leg with finish_reason ``error``: HTTP 500 "Internal server error" (streaming: an
  error event, then ``[DONE]``), vllm:nixl_num_failed_transfers +1 and
  vllm:request_success{finished_reason="error"} +1. After a failed handshake (unreachable,
  wrong engine) the prefill blocks wait for their expiry; after bad block ids they are
  released (as observed on vLLM 0.32). An unknown or expired ``remote_request_id`` is *not* an
  error: NIXL reads blocks by id, so the decode runs on whatever the blocks hold (this
  prompt's KV if they were not reused since, otherwise someone else's, which changes the
  output text) and the prefill engine counts vllm:nixl_num_notifications_after_expiry.
* A read the prefill engine refuses (the ``kv_refuse`` fault, :mod:`engine_model.faults`) is vLLM's
  ``transfer_failed`` (the READ ends in state ERR): the same error finish, and no notification
  (the notification rides on the failed READ), so the prefill blocks wait for their expiry.
* ``kv_load_failure_policy=recompute`` (vLLM's other policy) turns every failure above into
  a local recompute, as vLLM's ``_handle_failed_recving`` does: the decode leg's blocks are
  freed, it goes back to the waiting queue with nothing computed, looks its prefix cache up
  again and prefills the whole prompt itself; the client sees a normal answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine_model.config import SimConfig, attention_pairs
from engine_model.faults import Faults
from engine_model.kv import KVClient, KVError
from engine_model.kv_events import EventSink
from engine_model.metrics import SimMetrics
from engine_model.prefix import BlockPool, engine_hash_spec, extend_digests
from engine_model.tokens import OutputContext, OutputVocab, block_chain

log = logging.getLogger("engine_model.engine")

PLAIN, PREFILL, DECODE = "plain", "prefill", "decode"
WAITING, REMOTE_KV, RUNNING, FINISHED = "waiting", "remote_kv", "running", "finished"

_now = time.monotonic


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Collector:
    """Wakes the HTTP side of one request when any of its seqs produced or finished."""

    __slots__ = ("done", "event", "pending")

    def __init__(self, n: int) -> None:
        self.event = asyncio.Event()
        self.pending = n
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Seq:
    """One engine request (one prompt, one choice)."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "collector",
        "context",
        "counted_prompt",
        "created_cache_tokens",
        "digests",
        "error",
        "external_tokens",
        "final_sent",
        "finish_reason",
        "finished_t",
        "first_token_t",
        "ignore_eos",
        "in_prefill",
        "kind",
        "kv_in",
        "kv_out",
        "kv_pulled",
        "last_token_t",
        "local_hit",
        "max_tokens",
        "min_tokens",
        "n_param",
        "num_cached_blocks",
        "num_computed",
        "num_preemptions",
        "output_ids",
        "pieces",
        "prompt_ids",
        "prompt_len",
        "pull_task",
        "remote_released",
        "req_id",
        "scheduled_t",
        "state",
        "stop_reason",
        "stop_strs",
        "stop_token_ids",
        "text_len_sent",
        "tokens_sent",
    )

    def __init__(
        self,
        req_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        kind: str = PLAIN,
        min_tokens: int = 0,
        choice: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        kv_in: dict[str, Any] | None = None,
        n_param: int = 1,
        collector: Collector | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.kind = kind
        self.stop_strs = tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.kv_in = kv_in
        self.n_param = n_param
        self.collector = collector
        self.context = OutputContext(prompt_ids, salt=choice.to_bytes(4, "little") if choice else b"")
        self.state = WAITING
        self.arrival = _now()
        self.scheduled_t: float | None = None
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.finished_t: float | None = None
        self.output_ids: list[int] = []
        self.pieces: list[str] = []
        self.num_computed = 0
        self.blocks: list[int] = []
        self.digests: list[bytes] = []  # chained block hashes of its full blocks, grown lazily
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.local_hit = 0  # prompt tokens found in the local prefix cache at first admission
        self.cached_tokens = 0  # usage.prompt_tokens_details.cached_tokens
        self.created_cache_tokens = 0  # ... .created_cache_tokens (chat)
        self.in_prefill = True
        self.counted_prompt = False
        self.external_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.kv_out: dict[str, Any] | None = None
        self.kv_pulled = False
        self.remote_released = False
        self.pull_task: asyncio.Task[None] | None = None
        self.error: str | None = None
        self.tokens_sent = 0  # streaming bookkeeping (sim.app)
        self.text_len_sent = 0
        self.final_sent = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    def text(self) -> str:
        text = "".join(self.pieces)
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            cut = text.find(self.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text


@dataclass
class Held:
    """A prefill leg's blocks kept for a decode engine to pull."""

    request_id: str
    block_ids: list[int]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class Engine:
    def __init__(
        self,
        cfg: SimConfig,
        metrics: SimMetrics,
        vocab: OutputVocab,
        kv_client: KVClient | None = None,
        publisher: EventSink | None = None,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: what timestamps requests (a fleet on a virtual clock passes its loop's)."""
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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    # ------------------------------------------------------------------ state
    def kv_usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block (AllBlocksCleared). Refused
        while blocks are in use (running requests, held prefill blocks, KV loads); with
        ``reset_running_requests`` the running requests are preempted first."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running[-1])
        ok = self.pool.reset()
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
        if self.publisher is not None and self.pool.events:
            self.publisher.publish(self.pool.take_events())

    def update_gauges(self) -> None:
        m = self.m
        capacity = len(self.waiting) + len(self.ready_kv)
        deferred = len(self.remote_kv)
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
        self.waiting.append(seq)
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """Client went away: drop the seq now and give its blocks back."""
        if seq.state == FINISHED:
            return
        state = seq.state
        if state == WAITING:
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
            extend_digests(seq.digests, seq.prompt_ids + seq.output_ids, max_blocks, spec)
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
        extend_digests(seq.digests, tokens, full, spec)
        self.pool.cache(seq.blocks, seq.digests, done, full, tokens)
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

    def _record_content(self, seq: Seq) -> None:
        src = self.block_src
        upto = seq.num_computed
        bs = self.cfg.block_size
        for i, b in enumerate(seq.blocks):
            src[b] = (seq, i, upto) if upto > i * bs else None

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
    async def _loop(self) -> None:  # noqa: C901 - over the limit before it was set; to split
        cfg = self.cfg
        m = self.m
        while True:
            if not (self.running or self.waiting or self.ready_kv):
                self._publish_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch: list[tuple[Seq, int]] = []
            budget = cfg.max_num_batched_tokens
            prefill_tokens = 0
            decode_tokens = 0
            now = self._clock()

            for seq in list(self.running):
                if seq.state != RUNNING:
                    continue  # preempted by an earlier seq of this step
                if budget <= 0:
                    break
                chunk = min(seq.num_tokens - seq.num_computed, budget)
                while not self._grow(seq, seq.num_computed + chunk):
                    self._preempt(self.running[-1])
                    if seq.state != RUNNING:
                        break
                if seq.state != RUNNING:
                    continue
                self._cache_blocks(seq, seq.num_computed + chunk)
                batch.append((seq, chunk))
                budget -= chunk
                if seq.in_prefill:
                    prefill_tokens += chunk
                else:
                    decode_tokens += chunk

            while budget > 0 and len(self.running) < cfg.max_num_seqs:
                queue = self.ready_kv or self.waiting
                if not queue:
                    break
                seq = queue[0]
                fresh = seq.num_computed == 0  # vLLM looks the prefix cache up for these
                hits = self._lookup(seq) if fresh else []
                local = len(hits) * cfg.block_size
                if seq.kind == DECODE and not seq.kv_pulled:
                    # Local hits first; the rest of the prompt is loaded from the prefill engine.
                    if not self._admit_blocks(seq, hits, seq.prompt_len):
                        break
                    queue.popleft()
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
                    continue
                chunk = min(seq.num_tokens - max(seq.num_computed, local), budget)
                if fresh:
                    if not self._admit_blocks(seq, hits, local + chunk):
                        break
                    seq.num_computed = local
                elif not self._grow(seq, seq.num_computed + chunk):
                    break
                queue.popleft()
                seq.state = RUNNING
                if fresh:
                    self._record_admission(seq, local)
                if seq.scheduled_t is None:
                    seq.scheduled_t = now
                    m.ext_prefix_queries.inc(seq.num_tokens - local)
                self._cache_blocks(seq, seq.num_computed + chunk)
                self.running.append(seq)
                batch.append((seq, chunk))
                budget -= chunk
                prefill_tokens += chunk

            if not batch:
                # Nothing can run (no blocks, or only KV loads in flight): wait for a change.
                self._publish_events()
                self._wake.clear()
                await self._wake.wait()
                continue

            decode_seqs = context = 0
            pairs = 0.0
            for seq, chunk in batch:
                if not seq.in_prefill:
                    decode_seqs += 1
                    context += seq.num_computed + chunk
                elif cfg.prefill_attention_time:
                    pairs += attention_pairs(chunk, seq.num_computed)
            await asyncio.sleep(cfg.step_time(prefill_tokens, decode_seqs, context, pairs))

            now = self._clock()
            generated = 0
            for seq, chunk in batch:
                if seq.state != RUNNING:
                    continue  # aborted during the step
                seq.num_computed += chunk
                if seq.num_computed >= seq.num_tokens:
                    self._sample(seq, now)
                    generated += 1
            m.iteration_tokens.observe(prefill_tokens + generated)
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

    # ------------------------------------------------------------------ prefill side
    def _hold(self, seq: Seq) -> None:
        cfg = self.cfg
        self._record_content(seq)
        held = Held(request_id=seq.req_id, block_ids=seq.blocks)
        seq.blocks = []
        held.timer = asyncio.get_running_loop().call_later(cfg.kv_expiry, self._expire, seq.req_id)
        self.held[seq.req_id] = held
        seq.kv_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(held.block_ids)],
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": seq.req_id,
            "remote_host": cfg.advertised_kv_host,
            "remote_port": self.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": seq.num_computed,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": seq.local_hit,
        }

    def _release_held(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        if held.timer is not None:
            held.timer.cancel()
        self.pool.release(held.block_ids)
        self._wake.set()
        return True

    def _expire(self, request_id: str) -> None:
        if self._release_held(request_id):
            self.m.nixl_kv_expired.inc()
            log.warning("Releasing expired KV blocks for request %s (no decode engine pulled them)", request_id)

    # Side-channel operations (called by engine_model.kv.KVServer) --------------------
    def kv_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A decode engine reads blocks by id. Like a NIXL READ it gets whatever the blocks
        hold now (``tags`` describe that KV), whether or not the handle is still known.
        ``first_block``: the position of the first block read in the request (a decode engine
        with a local prefix hit reads only the blocks after it)."""
        own = self.cfg.engine_id
        if msg.get("engine_id") != own:
            return {"status": "engine_mismatch", "engine_id": own}
        groups = msg.get("block_ids")
        limit = self.cfg.num_gpu_blocks
        if groups is None:  # not iterable: the TypeError below would say the same
            return {"status": "bad_blocks", "engine_id": own}
        try:
            flat = [b for g in groups for b in g]
            if not all(type(b) is int and 0 <= b < limit for b in flat):
                raise ValueError
        except (TypeError, ValueError):
            return {"status": "bad_blocks", "engine_id": own}
        first = msg.get("first_block") or 0
        if type(first) is not int or first < 0:
            return {"status": "bad_blocks", "engine_id": own}
        if self.faults is not None and self.faults.refuse_kv_read():
            log.warning("fault: refusing the KV read of request %s", msg.get("request_id"))
            return {"status": "refused", "engine_id": own}
        rid = msg.get("request_id")
        held = self.held.get(rid) if rid is not None else None
        known = held is not None and held.block_ids[first : first + len(flat)] == flat
        n_req = msg.get("num_tokens")
        bs = self.cfg.block_size
        chains: dict[int, list[str]] = {}
        tags: list[str | None] = []
        for i, b in enumerate(flat, start=first):
            src = self.block_src[b]
            if src is None or src[1] != i:
                tags.append(None)  # garbage, or KV of another position
                continue
            seq, _, upto = src
            chain = chains.get(id(seq))
            if chain is None:
                n = min(upto, n_req) if isinstance(n_req, int) and n_req > 0 else upto
                chain = chains[id(seq)] = block_chain((seq.prompt_ids + seq.output_ids)[:n], bs)
            tags.append(chain[i] if i < len(chain) else None)
        return {"status": "ok" if known else "unknown", "engine_id": own, "block_size": bs, "tags": tags}

    def kv_notify(self, msg: dict[str, Any]) -> dict[str, Any]:
        own = self.cfg.engine_id
        if msg.get("engine_id") != own:
            return {"status": "engine_mismatch", "engine_id": own}
        rid = msg.get("request_id")
        if rid is not None and self._release_held(rid):
            return {"status": "ok", "engine_id": own}
        self.m.nixl_notifs_after_expiry.inc()
        log.error(
            "Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode "
            "worker. They may have expired.",
            msg.get("request_id"),
        )
        return {"status": "unknown", "engine_id": own}

    def kv_heartbeat(self, msg: dict[str, Any]) -> dict[str, Any]:
        own = self.cfg.engine_id
        if msg.get("engine_id") != own:
            return {"status": "engine_mismatch", "engine_id": own}
        loop = asyncio.get_running_loop()
        extension = self.cfg.kv_expiry * 2 / 3
        for rid in msg.get("request_ids") or ():
            held = self.held.get(rid)
            if held is None or held.timer is None:
                continue
            if held.timer.when() < loop.time() + extension:
                held.timer.cancel()
                held.timer = loop.call_later(extension, self._expire, rid)
        return {"status": "ok", "engine_id": own}

    # ------------------------------------------------------------------ decode side
    @staticmethod
    def _remote(seq: Seq) -> tuple[str, int, str, str]:
        kv = seq.kv_in or {}
        return kv["remote_host"], int(kv["remote_port"]), kv["remote_engine_id"], kv["remote_request_id"]

    def _release_remote(self, seq: Seq) -> None:
        if seq.remote_released or seq.kv_in is None:
            return
        seq.remote_released = True
        self.release_remote(seq.kv_in)

    def release_remote(self, kv: dict[str, Any]) -> None:
        """Tell a prefill engine to drop the blocks a decode leg's kv_transfer_params name."""
        try:
            host, port = kv["remote_host"], int(kv["remote_port"])
            engine_id, rid = kv["remote_engine_id"], kv["remote_request_id"]
        except (KeyError, TypeError, ValueError):
            return
        self._spawn(self._notify(host, port, engine_id, rid))

    async def _notify(self, host: str, port: int, engine_id: str, rid: str) -> None:
        try:
            reply = await self.kv.call(host, port, {"op": "notify", "engine_id": engine_id, "request_id": rid})
            if reply.get("status") == "engine_mismatch":
                raise KVError("engine id mismatch on notify")
        except (KVError, OSError) as e:
            self.m.nixl_failed_notifications.inc()
            self.m.nixl_failed_transfers.inc()
            log.error("KV notification to %s:%s failed (%s); its blocks will be freed after expiry", host, port, e)

    async def _pull(self, seq: Seq, first_block: int = 0) -> None:
        """Load the prompt's KV after the first ``first_block`` blocks (a local prefix hit:
        vLLM's NIXL connector reads only the remote blocks the decode engine lacks)."""
        m = self.m
        cfg = self.cfg
        host, port, engine_id, rid = self._remote(seq)
        groups = (seq.kv_in or {}).get("remote_block_ids") or []
        if first_block:
            groups = [g[first_block:] if isinstance(g, list) else g for g in groups]
        read_done = False
        try:
            t0 = self._clock()
            try:
                reply = await self.kv.call(
                    host,
                    port,
                    {
                        "op": "read",
                        "engine_id": engine_id,
                        "request_id": rid,
                        "block_ids": groups,
                        "first_block": first_block,
                        "num_tokens": seq.prompt_len,
                    },
                )
            except (KVError, OSError) as e:
                # vLLM: handshake_failed; nothing reached the prefill engine, no notification.
                seq.remote_released = True
                log.error("NIXL transfer failure: handshake_failed with %s:%s (%s)", host, port, e)
                self._load_failed(seq, f"KV handshake with {host}:{port} failed: {e}")
                return
            status = reply.get("status")
            if reply.get("engine_id") != engine_id:
                seq.remote_released = True
                log.error(
                    "NIXL transfer failure: Remote NIXL agent engine ID mismatch. Expected %s, received %s.",
                    engine_id,
                    reply.get("engine_id"),
                )
                self._load_failed(seq, "Remote NIXL agent engine ID mismatch")
                return
            if status == "bad_blocks":
                # Observed with vLLM 0.32: the request fails, and the prefill engine's blocks for
                # that handle are released right away.
                log.error("NIXL transfer failure: transfer_setup_failed for %s (bad block ids)", rid)
                self._release_remote(seq)
                self._load_failed(seq, "KV transfer setup failed: invalid remote block ids")
                return
            if status == "refused":
                # vLLM: the READ ends in state ERR (transfer_failed); its notification is lost
                # with it, so the prefill engine keeps the blocks until they expire.
                seq.remote_released = True
                log.error("NIXL transfer failure: transfer_failed for %s (read refused by %s:%s)", rid, host, port)
                self._load_failed(seq, "KV transfer failed: the prefill engine refused the read")
                return
            read_done = True
            post = self._clock() - t0
            n_ext = seq.prompt_len - seq.num_computed  # num_computed: the local hit
            wait = cfg.kv_transfer_time(n_ext)
            if wait:
                await asyncio.sleep(wait)
            xfer = self._clock() - t0
            expected = block_chain(seq.prompt_ids, int(reply.get("block_size") or cfg.block_size))[first_block:]
            tags = reply.get("tags") or []
            if tags[: len(expected)] != expected:
                # The blocks held someone else's KV (or nothing): the output is garbage, but
                # different garbage than a correct run (that is how to spot it from outside).
                seq.context = OutputContext(seq.prompt_ids, salt=b"foreign-kv:" + orjson.dumps(tags))
            n_blocks = sum(len(g) for g in groups)
            m.nixl_xfer_time.observe(xfer)
            m.nixl_post_time.observe(post)
            m.nixl_bytes.observe(n_blocks * cfg.block_size * cfg.kv_bytes_per_token)
            m.nixl_descriptors.observe(n_blocks * 2)
            seq.external_tokens = n_ext
            # vLLM caches the loaded blocks once they arrived, then recomputes the last prompt
            # token (a full hit) to sample.
            self._cache_blocks(seq, seq.prompt_len)
            seq.num_computed = seq.prompt_len - 1
            seq.kv_pulled = True
            self.remote_kv.discard(seq)
            seq.state = WAITING
            self.ready_kv.append(seq)
            self._wake.set()
        finally:
            if read_done or seq.state == FINISHED:
                # After the read (or if dropped mid-way) the prefill engine gets its
                # notification and frees the blocks.
                self._release_remote(seq)

    def _fail(self, seq: Seq, why: str) -> None:
        seq.error = why
        self._finish(seq, "error", self._clock())

    def _load_failed(self, seq: Seq, why: str) -> None:
        """A decode leg's KV pull failed: count it, then apply ``kv_load_failure_policy``."""
        self.m.nixl_failed_transfers.inc()
        if self.cfg.kv_load_failure_policy == "fail":
            self._fail(seq, why)
            return
        # recompute: vLLM's _handle_failed_recving sets num_computed_tokens to 0 and frees the
        # blocks; the request waits again and prefills its whole prompt locally.
        log.warning("Recovered from KV load failure: request %s rescheduled (%s)", seq.req_id, why)
        self.remote_kv.discard(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.kv_pulled = True  # nothing left to load: it runs as a local request
        seq.state = WAITING
        self.ready_kv.append(seq)
        self._wake.set()

    # ------------------------------------------------------------------ heartbeats
    async def _heartbeat_loop(self) -> None:
        """Decode legs still queued keep their remote KV alive (vLLM's lease heartbeats)."""
        interval = max(self.cfg.kv_expiry / 6, 0.05)
        while True:
            await asyncio.sleep(interval)
            by_peer: dict[tuple[str, int, str], list[str]] = {}
            for seq in self.waiting:
                if seq.kind == DECODE and not seq.kv_pulled and seq.kv_in is not None:
                    host, port, engine_id, rid = self._remote(seq)
                    by_peer.setdefault((host, port, engine_id), []).append(rid)
            for (host, port, engine_id), rids in by_peer.items():
                self._spawn(self._heartbeat(host, port, engine_id, rids))

    async def _heartbeat(self, host: str, port: int, engine_id: str, rids: list[str]) -> None:
        with contextlib.suppress(KVError, OSError):
            await self.kv.call(host, port, {"op": "hb", "engine_id": engine_id, "request_ids": rids})
