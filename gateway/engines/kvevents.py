"""Follow one vLLM engine's KV cache events and keep its precise prefix-index entries true.

Wire protocol (vLLM 0.32, ``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``):

- The engine runs with ``--enable-prefix-caching --kv-events-config '{"enable_kv_cache_events":
  true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
  "topic": "kv@engine-1"}'`` (other fields: ``buffer_steps`` batches kept for replay, default
  10000; ``hwm``; ``max_queue_size``). ``*`` endpoints are bound by the engine; we connect.
- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` is a per-process counter from 0 as
  8-byte big-endian; ``payload`` is msgpack of ``KVEventBatch``, an array ``[ts, events,
  data_parallel_rank?]``. Events are tagged maps: ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
  "extra_keys"?, "group_idx"?, ...}``, ``{"type": "BlockRemoved", "block_hashes", "medium",
  "group_idx"?}``, ``{"type": "AllBlocksCleared"}`` (fields equal to their default are left out).
  Older vLLM encoded events as arrays with the tag first; both are read. Hashes are ints unless
  the engine sets ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (see ``policies/beliefs/blockhash.py``).
- ROUTER replay socket: send ``(b"", start_seq as 8-byte big-endian)`` from a DEALER; the engine
  answers every buffered batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)`` (older
  vLLM: ``(b"", seq, payload)``) and ends with ``seq = -1`` (signed) and an empty payload.
- Events leave the engine with its scheduler steps: an idle engine publishes nothing (so silence
  says nothing about liveness), and an ``AllBlocksCleared`` from ``/reset_prefix_cache`` arrives
  only with the next request's step.

How the feed stays trustworthy: on every (re)connection the engine's precise entries are
dropped and rebuilt from the replay buffer (the engine may have restarted or we may have missed
removals); a sequence gap is filled from the replay buffer; a sequence going back means a new
engine process (resync); ``AllBlocksCleared`` clears. When a gap cannot be filled, the entries
are dropped and rebuilt from what the buffer still has: missing a BlockStored only loses
affinity, missing a BlockRemoved would route to blocks that are gone. ZMQ itself reconnects,
with exponential backoff (``reconnect_ivl_s`` up to ``reconnect_ivl_max_s``), and heartbeats
detect an engine that vanished without closing its connection.

When the engines' hashes cannot be reproduced (``not spec.reproducible``: xxhash without
PYTHONHASHSEED) the subscriber translates: each BlockStored's token ids are hashed into the
gateway's own chain, continuing from the gateway digest of the event's parent, and a map from
engine hash to gateway digest lets BlockRemoved be applied too.

What a feed can make the gateway do is bounded, whoever publishes on it (the feed is plain,
unauthenticated ZMQ: anyone who can take an engine's event address on the network can publish;
docs/operations.md, "KV event feeds"). A message longer than ``max_message_bytes`` never reaches
Python: ``ZMQ_MAXMSGSIZE`` makes ZMQ drop the peer's connection on reading its size (the feed then
reconnects and resyncs); the receive queues hold a few such messages at most (``RCVHWM``). A batch
is decoded outline first, every field left raw, then field by field with bounded types (msgspec
checks a list's length on its header, before building an item): one carrying more than
``max_batch_blocks`` hashes, in all its events, is refused after at most twice that many decoded.
A refused or undecodable batch drops the engine's entries, as a lost one would (it may have held
removals). What is applied goes to the index in slices that give the event loop back every
``SLICE_S`` of work, so a large batch delays requests by one slice, not by the whole batch. The
feed's troubles (gaps, restarts, refused messages, disconnects) are logged at most once per
``LOG_INTERVAL_S``, the rest counted into that line, and replays are rate-limited: a forged
"restart" per message must not make the engine replay its whole buffer per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio
from cachetools import LRUCache
from zmq.utils.monitor import parse_monitor_message

from gateway.background import cancel_checkpoint, stop_task
from gateway.engines.kvfeedreport import LOG_INTERVAL_S, FeedLog, KVEventCounters
from gateway.engines.kvwire import (
    END_SEQ,
    LOCALITY_REMOTE,
    MEDIUM_GPU,
    SEQ_BYTES,
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    FeedLimits,
)
from policies.beliefs.blockhash import BlockHash, Digest, HashSpec, block_digests
from policies.beliefs.prefix_index import PrefixStore
from policies.beliefs.tiers import TierIndex

log = logging.getLogger(__name__)


# Bounds (the configurable ones are routing.prefix.max_event_*; docs/configuration.md)
SLICE_S = 0.02  # longest run of feed work before the event loop gets a turn
CHUNK_BLOCKS = 4096  # blocks per index call within a slice
REPLAY_BURST = 3  # replays asked for at once at most...
REPLAY_EVERY_S = 1.0  # ...then one per this long; a gap or restart beyond that drops the entries instead
REPLAY_WHOLE_S = 60.0  # longest a replay may take in all (each message within replay_timeout_s)


# -- the subscriber --------------------------------------------------------------------------------


class KVEventSubscriber:
    """Applies one engine's KV events to a ``PrefixStore`` under the engine's url.

    ``endpoint``/``replay_endpoint``: the engine's publisher and replay addresses as we connect to
    them (``tcp://10.0.0.5:5557``). ``topic``: the engine's ``kv-events-config`` topic (empty: all).
    ``spec``: the engines' ``HashSpec`` (needed to translate unreproducible hashes; with
    ``translate=None`` translation is on exactly when ``not spec.reproducible``). ``group_idx``:
    the KV cache group whose blocks count (0: a plain decoder's only group; None: all).
    ``limits``: the feed's bounds; ``max_translations``: the engine hashes remembered (translation).
    """

    def __init__(
        self,
        url: str,
        endpoint: str,
        *,
        index: PrefixStore,
        replay_endpoint: str | None = None,
        topic: str = "",
        spec: HashSpec | None = None,
        translate: bool | None = None,
        group_idx: int | None = 0,
        replay_timeout_s: float = 5.0,
        reconnect_ivl_s: float = 0.2,
        reconnect_ivl_max_s: float = 10.0,
        heartbeat_s: float = 5.0,
        max_translations: int = 262_144,
        limits: FeedLimits | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
        tiers: TierIndex | None = None,
    ) -> None:
        self.tiers = tiers  # where other media's blocks go (None: ignored, GPU beliefs only)
        if translate is None:
            translate = spec is not None and not spec.reproducible
        if translate and spec is None:
            raise ValueError("translating engine hashes needs the HashSpec")
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.index = index
        self.spec = spec
        self.translate = translate
        self.group_idx = group_idx
        self.replay_timeout_s = replay_timeout_s
        self.reconnect_ivl_s = reconnect_ivl_s
        self.reconnect_ivl_max_s = reconnect_ivl_max_s
        self.heartbeat_s = heartbeat_s
        self.max_translations = max_translations
        self.limits = limits or FeedLimits()
        self.counters = KVEventCounters()
        self._own_ctx = context is None
        self._ctx = context
        self._clock = clock
        self._decoder = BatchDecoder(self.limits.max_batch_blocks, spec.unit if translate and spec else None)
        self._log = FeedLog(url, log_interval_s)
        self._topic = topic.encode()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_seq: int | None = None  # None: no baseline (nothing to compare the next seq to)
        self._skip_upto: int | None = None  # live batches up to this seq came through a replay already
        self._xlate = self._translations()
        self._warned_block_size = False
        self._slice_start = time.monotonic()  # when the event loop last had a turn
        self._replay_tokens = float(REPLAY_BURST)
        self._replay_checked = time.monotonic()
        self._connected_at = 0.0
        self._reconnect_at: float | None = None  # when to connect again ourselves (see _on_monitor)
        self._reconnect_after_s = reconnect_ivl_s

    # -- lifecycle -------------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Bounds ZMQ keeps before Python sees a byte: a longer message drops its connection.
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.limits.queued_messages)
        return sock

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.reconnect_ivl_s * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.reconnect_ivl_max_s * 1000)))
        if self.heartbeat_s > 0:
            sub.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_s * 3000))
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kvevents {self.url}")

    async def stop(self) -> None:
        """Stop following; the engine's precise entries go (nothing keeps them true any more)."""
        task, self._task = self._task, None
        await stop_task(task)  # bounded: a swallowed cancel or a stuck replay cannot hang shutdown
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._own_ctx and self._ctx is not None:
            # destroy, not term: term() blocks the loop until every socket is closed, and a task
            # that would not stop may still hold its replay socket
            self._ctx.destroy(linger=0)
            self._ctx = None
        self.counters.connected = False
        self.index.set_precise(self.url, False)
        self.index.cleared(self.url)
        self._xlate = self._translations()
        self._log.flush(force=True)

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)
            try:
                # wakes at least once per log interval, to tell what the feed log held back
                wait_s = self._log.interval_s
                if self._reconnect_at is not None:
                    wait_s = max(0.0, min(wait_s, self._reconnect_at - time.monotonic()))
                ready = dict(await poller.poll(int(wait_s * 1000)))
                self._slice_start = time.monotonic()
                self._log.flush()
                if self._monitor in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            await self._on_monitor(await self._monitor.recv_multipart(zmq.NOBLOCK))
                if self._reconnect_at is not None and time.monotonic() >= self._reconnect_at:
                    self._reconnect()
                if self._sub in ready:
                    for _ in range(256):  # a bounded drain, then let the loop breathe
                        try:
                            frames = await self._sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_message(frames)
                        await self._breathe()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step end the feed
                self._log("unexpected errors", logging.ERROR, "unexpected error", exc_info=True)
                await asyncio.sleep(self.reconnect_ivl_s)

    async def _breathe(self) -> None:
        """Give the event loop a turn once ``SLICE_S`` of feed work has run without one."""
        if time.monotonic() - self._slice_start >= SLICE_S:
            await asyncio.sleep(0)
            self._slice_start = time.monotonic()

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        c = self.counters
        if event == zmq.EVENT_CONNECTED:
            self._connected_at, self._reconnect_at = time.monotonic(), None
            c.connects += 1
            if c.connects > 1:
                c.reconnects += 1
            c.connected = True
            self._log("connects", logging.INFO, "connected to %s", self.endpoint)
            self.index.set_precise(self.url, True)
            await self._resync()
        elif event == zmq.EVENT_DISCONNECTED:
            c.disconnects += 1
            c.connected = False
            self._log("disconnects", logging.WARNING, "disconnected from %s", self.endpoint)
            self.index.set_precise(self.url, False)
            # ZMQ reconnects after a lost connection (it says so: EVENT_CONNECT_RETRIED, at once),
            # but not after a protocol error, such as a message over max_message_bytes: then we
            # connect again, backing off while connections end at once (a peer sending only those).
            now = time.monotonic()
            if now - self._connected_at >= self.reconnect_ivl_max_s:
                self._reconnect_after_s = self.reconnect_ivl_s
            self._reconnect_at = now + self._reconnect_after_s
            self._reconnect_after_s = min(self._reconnect_after_s * 2, self.reconnect_ivl_max_s)
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._reconnect_at = None

    def _reconnect(self) -> None:
        assert self._sub is not None
        self._reconnect_at = None
        with contextlib.suppress(zmq.ZMQError):  # the ended session may be gone already
            self._sub.disconnect(self.endpoint)
        self._sub.connect(self.endpoint)

    async def _resync(self, until_seq: int | None = None) -> None:
        """Drop the engine's precise entries and rebuild them from its replay buffer."""
        self.counters.resyncs += 1
        self._clear()
        self._last_seq = None
        self._skip_upto = None
        if self.replay_endpoint is None or not self._may_replay():
            return
        got = await self._replay(0, until_seq, contiguous_from=None)
        if got is not None:
            self._last_seq = got
            if until_seq is None:
                self._skip_upto = got

    def _may_replay(self) -> bool:
        """Whether a replay may be asked for now (``REPLAY_BURST``, then one per ``REPLAY_EVERY_S``)."""
        now = time.monotonic()
        self._replay_tokens = min(REPLAY_BURST, self._replay_tokens + (now - self._replay_checked) / REPLAY_EVERY_S)
        self._replay_checked = now
        if self._replay_tokens < 1:
            return False
        self._replay_tokens -= 1
        return True

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self.counters.decode_errors += 1
            self._log("malformed", logging.WARNING, "a message of %d frames is not (topic, seq, payload)", len(frames))
            return
        topic, seq_bytes, payload = frames
        if self._topic and topic != self._topic:
            return  # SUBSCRIBE matches prefixes; the engine's topic is exact
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self._skip_upto is not None:
            if seq <= self._skip_upto:
                self.counters.duplicates += 1
                return
            self._skip_upto = None
        last = self._last_seq
        if last is not None and seq <= last:
            self.counters.restarts += 1
            self._log("restarts", logging.WARNING, "sequence went back (%d after %d): engine restarted", seq, last)
            await self._resync(until_seq=seq)
        elif last is not None and seq > last + 1:
            self.counters.gaps += 1
            self._log("gaps", logging.WARNING, "missed batches %d..%d", last + 1, seq - 1)
            if self.replay_endpoint is None or not self._may_replay():
                self.counters.resyncs += 1
                self._clear()
            else:
                await self._replay(last + 1, seq, contiguous_from=last + 1)
        await self._apply(seq, payload)

    async def _replay(self, start: int, until_seq: int | None, contiguous_from: int | None) -> int | None:
        """Ask the replay socket for batches from ``start``; apply those before ``until_seq``.

        If the buffer no longer reaches back to ``contiguous_from``, or a batch is missing in what
        it sends (the engine's ROUTER drops what does not fit our queue), or the replay fails, the
        current entries cannot be trusted: drop them, then apply the rest. Returns the last
        sequence number applied (-1 for an empty buffer), or None when the replay failed.
        """
        assert self._ctx is not None and self.replay_endpoint is not None
        self.counters.replays += 1
        dealer = self._socket(zmq.DEALER)
        last: int | None = None
        expected = contiguous_from
        first = True
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the frames do
            async with asyncio.timeout(REPLAY_WHOLE_S):  # a peer trickling batches cannot hold the feed
                while True:
                    async with asyncio.timeout(self.replay_timeout_s):
                        frames = await dealer.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) == 3:
                        _, seq_bytes, payload = frames
                    elif len(frames) == 2:
                        seq_bytes, payload = frames
                    else:
                        raise DecodeError(f"replay answered {len(frames)} frames")
                    if len(seq_bytes) != SEQ_BYTES:
                        raise DecodeError(f"replay answered a sequence number of {len(seq_bytes)} bytes")
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if expected is not None and seq != expected:
                        self._replay_fell_short(expected, seq, first)
                    first = False
                    expected = seq + 1
                    if until_seq is not None and seq >= until_seq:
                        break  # the live feed has the rest
                    await self._apply(seq, payload)
                    last = seq
                    await self._breathe()
        except (TimeoutError, zmq.ZMQError, DecodeError) as err:
            self.counters.replay_failures += 1
            self._log(
                "replay failures", logging.WARNING, "replay from %d failed (%r): dropping its entries", start, err
            )
            self.counters.resyncs += 1
            self._clear()
            return None
        finally:
            dealer.close(linger=0)
        if first and contiguous_from is not None and until_seq is not None:
            self._replay_fell_short(contiguous_from, None, True)  # empty buffer yet a gap: lost
        return last if last is not None else (start - 1)

    def _replay_fell_short(self, wanted: int, got: int | None, first: bool) -> None:
        self.counters.replay_failures += 1
        self.counters.resyncs += 1
        if first:
            self._log(
                "replay failures", logging.WARNING, "replay starts at %s, needed %d: dropping its entries", got, wanted
            )
        else:
            self._log(
                "replay failures", logging.WARNING, "replay skipped from %d to %s: dropping its entries", wanted, got
            )
        self._clear()

    def _clear(self) -> None:
        self.index.cleared(self.url)
        self._xlate = self._translations()

    def _translations(self) -> LRUCache[BlockHash, Digest]:
        """A fresh engine hash -> gateway digest map, LRU-bounded by ``max_translations``. Dropping
        the old one is how it is cleared: ``LRUCache.clear`` pops entries one by one in Python,
        seconds on the event loop for a full map."""
        return LRUCache(max(self.max_translations, 1))

    # -- applying batches ------------------------------------------------------------------------

    async def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events = self._decoder.decode(payload)
        except DecodeError as err:
            # The batch took a sequence number: like a lost one it may have held removals.
            self.counters.decode_errors += 1
            self.counters.resyncs += 1
            self._log("malformed", logging.WARNING, "batch %d refused (%s): dropping its entries", seq, err)
            self._clear()
            self._last_seq = seq
            return
        c = self.counters
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                c.cleared_events += 1
                self._clear()
                continue
            if self.group_idx is not None and ev.group_idx not in (None, self.group_idx):
                c.ignored += 1
                continue
            if ev.medium is not None and ev.medium.upper() != MEDIUM_GPU:  # LMCache and Mooncake write "cpu"
                # Another tier's copy (CPU offload, LMCache through the MultiConnector): nothing
                # about the GPU cache; the tier beliefs take it when they are on.
                if self.tiers is None:
                    c.ignored += 1
                else:
                    self._tier_event(self.tiers, ev)
                continue
            if isinstance(ev, BlockStored):
                await self._stored(ev)
            else:
                await self._removed(ev)
            await self._breathe()
        c.events_applied += len(events)
        c.batches_applied += 1
        c.last_seq = self._last_seq = seq
        c.last_event_time = self._clock()
        c.last_batch_ts = ts

    def _tier_event(self, tiers: TierIndex, ev: BlockStored | BlockRemoved) -> None:
        """A store or removal in a tier below the GPU: L2 when vLLM says the tier is REMOTE to the
        engine, else the engine's own L1. The engine's hashes stand as they are when they are the
        gateway's; else only blocks whose translation the GPU's events taught (offloaded blocks were
        GPU blocks first). A store in other units than the engine's blocks is not matchable: LMCache's
        256-token chunk hashes, or vLLM's offload placeholders naming a chunk's last block only
        (``block_size`` 0; its ``self_describing_kv_events`` names every block): docs/kv-tiers.md."""
        if isinstance(ev, BlockStored) and self.spec is not None and ev.block_size != self.spec.unit:
            self.counters.untranslatable += 1
            return
        hashes = ev.block_hashes
        if self.translate:
            assert self.spec is not None
            known = (self._xlate.get(h) for h in hashes)
            hashes = [self.spec.external(d) for d in known if d is not None]
        remote = ev.locality == LOCALITY_REMOTE
        if isinstance(ev, BlockStored):
            tiers.stored(self.url, hashes, remote=remote)
        else:
            tiers.removed(self.url, hashes, remote=remote)
        self.counters.tier_events += 1

    async def _in_slices(self, apply: Callable[[str, Sequence[BlockHash]], None], hashes: list[BlockHash]) -> None:
        for i in range(0, len(hashes), CHUNK_BLOCKS):
            apply(self.url, hashes[i : i + CHUNK_BLOCKS] if len(hashes) > CHUNK_BLOCKS else hashes)
            await self._breathe()

    async def _stored(self, ev: BlockStored) -> None:
        spec = self.spec
        if spec is not None and ev.block_size and ev.block_size != spec.unit and not self._warned_block_size:
            self._warned_block_size = True
            log.warning(
                "kv events %s: engine block size %d but the gateway hashes %d-token blocks: prefix "
                "matches will miss; fix the model's block_size",
                self.url,
                ev.block_size,
                spec.unit,
            )
        if not self.translate:
            await self._in_slices(self.index.stored, ev.block_hashes)
            return
        assert spec is not None
        n, unit = len(ev.block_hashes), spec.unit
        if (ev.extra_keys and any(k is not None for k in ev.extra_keys)) or ev.block_size != unit:
            self.counters.untranslatable += 1
            return
        if len(ev.token_ids) // unit != n:
            self.counters.untranslatable += 1
            return
        parent: Digest | None = None
        if ev.parent_block_hash is not None:
            parent = self._xlate.get(ev.parent_block_hash)
            if parent is None:  # its parent was stored before we listened, or evicted
                self.counters.untranslatable += 1
                return
        for i in range(0, n, CHUNK_BLOCKS):
            digests = block_digests(ev.token_ids[i * unit : (i + CHUNK_BLOCKS) * unit], spec, parent=parent)
            xlate = self._xlate
            for engine_hash, digest in zip(ev.block_hashes[i : i + CHUNK_BLOCKS], digests, strict=True):
                xlate[engine_hash] = digest  # the most recent; evicts the least recently used past the bound
            self.index.stored(self.url, [spec.external(d) for d in digests])
            parent = digests[-1]
            await self._breathe()

    async def _removed(self, ev: BlockRemoved) -> None:
        if not self.translate:
            await self._in_slices(self.index.removed, ev.block_hashes)
            return
        assert self.spec is not None
        external = self.spec.external
        for i in range(0, len(ev.block_hashes), CHUNK_BLOCKS):
            gone = [self._xlate.pop(h, None) for h in ev.block_hashes[i : i + CHUNK_BLOCKS]]
            self.index.removed(self.url, [external(d) for d in gone if d is not None])
            await self._breathe()
