"""The P/D side of the simulated engine: prefill holds, the side-channel operations a prefill
engine answers, decode pulls and lease heartbeats (:class:`KVTransfer`, mixed into
:class:`engine_model.engine.Engine`).

It is kept apart from the scheduler because it is vLLM's NixlConnector, not its scheduler: it
decides what a finished prefill leg leaves behind and how a decode leg gets its KV, and calls the
scheduler only to free, cache and finish requests. What a block holds (``block_src``) lives here
too: a read serves whatever KV the blocks hold now, as NIXL does.

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
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from engine_model.config import SimConfig
from engine_model.faults import Faults
from engine_model.kv import KVClient, KVError
from engine_model.metrics import SimMetrics
from engine_model.prefix import BlockPool
from engine_model.seq import DECODE, FINISHED, WAITING, Held, Seq
from engine_model.tokens import OutputContext, block_chain

log = logging.getLogger("engine_model.engine")  # the engine's logger: one name for both halves


class KVTransfer:
    """A prefill leg's held blocks and a decode leg's pull, on top of the scheduler's state.

    :class:`engine_model.engine.Engine` sets the attributes below and implements the three
    scheduler operations this side calls (``_finish``, ``_free``, ``_cache_blocks``)."""

    cfg: SimConfig
    m: SimMetrics
    kv: KVClient
    kv_port: int
    faults: Faults | None
    pool: BlockPool
    # What each block holds: (seq whose KV it is, its index in that seq, tokens computed).
    # Like real KV memory it keeps its content after release, until reallocated.
    block_src: list[tuple[Seq, int, int] | None]
    held: dict[str, Held]
    waiting: deque[Seq]
    ready_kv: deque[Seq]
    remote_kv: set[Seq]
    _clock: Callable[[], float]
    _wake: asyncio.Event
    _bg: set[asyncio.Task[None]]

    # ------------------------------------------------------------------ the scheduler's side
    def _finish(self, seq: Seq, reason: str, now: float) -> None:
        raise NotImplementedError

    def _free(self, seq: Seq) -> None:
        raise NotImplementedError

    def _cache_blocks(self, seq: Seq, n_tokens: int) -> None:
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def _record_content(self, seq: Seq) -> None:
        src = self.block_src
        upto = seq.num_computed
        bs = self.cfg.block_size
        for i, b in enumerate(seq.blocks):
            src[b] = (seq, i, upto) if upto > i * bs else None

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
            # vLLM: prefill_stats.num_cached_tokens, local + external (offload tier) hits
            "remote_prefill_cached_tokens": seq.local_hit + seq.external_tokens,
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
                chain = chains[id(seq)] = block_chain((seq.prompt_ids + seq.output_ids)[:n], bs, salt=seq.kv_salt)
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
            bs = int(reply.get("block_size") or cfg.block_size)
            expected = block_chain(seq.prompt_ids, bs, salt=seq.kv_salt)[first_block:]
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
