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
  the engine sets ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (see ``policies/blockhash.py``).
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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from cachetools import LRUCache
from zmq.utils.monitor import parse_monitor_message

from policies.blockhash import BlockHash, Digest, HashSpec, block_digests
from policies.prefix_index import PrefixStore

from .tasks import cancel_checkpoint, stop_task

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end marker (signed)


# -- decoded events --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[Any] | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
MEDIUM_GPU = "GPU"  # vLLM's medium of its own (GPU) KV cache blocks


class DecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not a list")
    return value


def _event(raw: Any) -> Event | None:
    """One event from its msgpack form (tagged map, or tagged array in older vLLM); None for a
    type this gateway does not know (newer vLLM may add some)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            return BlockStored(
                _hashes(raw["block_hashes"]), raw.get("parent_block_hash"), raw.get("token_ids") or [],
                int(raw.get("block_size") or 0), raw.get("extra_keys"), raw.get("medium"), raw.get("group_idx"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(raw["block_hashes"]), raw.get("medium"), raw.get("group_idx"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(raw, list) and raw:
        kind = raw[0]
        if kind == "BlockStored" and len(raw) >= 5:
            # tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx
            extra = raw[8] if len(raw) > 8 else None
            return BlockStored(
                _hashes(raw[1]), raw[2], raw[3] or [], int(raw[4]), extra,
                raw[6] if len(raw) > 6 else None, raw[9] if len(raw) > 9 else None,
            )
        if kind == "BlockRemoved" and len(raw) >= 2:
            return BlockRemoved(_hashes(raw[1]), raw[2] if len(raw) > 2 else None, raw[3] if len(raw) > 3 else None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise DecodeError(f"an event is a {type(raw).__name__}")


def decode_batch(payload: bytes, decoder: msgspec.msgpack.Decoder[Any] | None = None) -> tuple[float, list[Event]]:
    """``(ts, events)`` of one ``KVEventBatch`` payload."""
    try:
        raw = (decoder or msgspec.msgpack.Decoder()).decode(payload)
    except msgspec.DecodeError as err:
        raise DecodeError(str(err)) from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    elif isinstance(raw, dict) and "events" in raw:
        ts, events = raw.get("ts", 0.0), raw["events"]
    else:
        raise DecodeError("not a KV event batch")
    if not isinstance(events, list):
        raise DecodeError("events is not a list")
    try:
        parsed = [_event(e) for e in events]
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise DecodeError(f"bad event: {err!r}") from None
    return float(ts or 0.0), [e for e in parsed if e is not None]


# -- the subscriber --------------------------------------------------------------------------------

@dataclass
class KVEventCounters:
    """For metrics. Times are wall-clock seconds (``time.time``); None until it happened."""

    batches_applied: int = 0
    events_applied: int = 0
    gaps: int = 0  # sequence gaps seen on the live feed
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that timed out or could not cover what was missing
    resyncs: int = 0  # times the engine's precise entries were dropped and rebuilt
    connects: int = 0
    reconnects: int = 0  # connects after the first
    disconnects: int = 0
    restarts: int = 0  # sequence went back: a new engine process
    cleared_events: int = 0  # AllBlocksCleared received
    duplicates: int = 0  # batches already applied (replay overlap)
    decode_errors: int = 0
    untranslatable: int = 0  # BlockStored events that could not be mapped (translation mode)
    ignored: int = 0  # events of another KV cache group
    last_seq: int | None = None
    last_event_time: float | None = None  # when the last batch was applied
    last_batch_ts: float | None = None  # the engine's own timestamp of that batch
    connected: bool = False


class KVEventSubscriber:
    """Applies one engine's KV events to a ``PrefixStore`` under the engine's url.

    ``endpoint``/``replay_endpoint``: the engine's publisher and replay addresses as we connect to
    them (``tcp://10.0.0.5:5557``). ``topic``: the engine's ``kv-events-config`` topic (empty: all).
    ``spec``: the engines' ``HashSpec`` (needed to translate unreproducible hashes; with
    ``translate=None`` translation is on exactly when ``not spec.reproducible``). ``group_idx``:
    the KV cache group whose blocks count (0: a plain decoder's only group; None: all).
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
        max_translations: int = 2_000_000,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
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
        self.counters = KVEventCounters()
        self._own_ctx = context is None
        self._ctx = context
        self._clock = clock
        self._decoder = msgspec.msgpack.Decoder()
        self._topic = topic.encode()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_seq: int | None = None  # None: no baseline (nothing to compare the next seq to)
        self._skip_upto: int | None = None  # live batches up to this seq came through a replay already
        self._xlate = self._translations()
        self._warned_block_size = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.reconnect_ivl_s * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.reconnect_ivl_max_s * 1000)))
        if self.heartbeat_s > 0:
            sub.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_s * 3000))
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
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

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/tasks.py)
            try:
                ready = dict(await poller.poll())
                if self._monitor in ready:
                    await self._on_monitor(await self._monitor.recv_multipart())
                if self._sub in ready:
                    for _ in range(256):  # a bounded drain, then let the loop breathe
                        try:
                            frames = await self._sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_message(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step end the feed
                log.exception("kv events %s: unexpected error", self.url)
                await asyncio.sleep(self.reconnect_ivl_s)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        c = self.counters
        if event == zmq.EVENT_CONNECTED:
            c.connects += 1
            if c.connects > 1:
                c.reconnects += 1
            c.connected = True
            log.info("kv events %s: connected to %s", self.url, self.endpoint)
            self.index.set_precise(self.url, True)
            await self._resync()
        elif event == zmq.EVENT_DISCONNECTED:
            c.disconnects += 1
            c.connected = False
            log.warning("kv events %s: disconnected from %s", self.url, self.endpoint)
            self.index.set_precise(self.url, False)

    async def _resync(self, until_seq: int | None = None) -> None:
        """Drop the engine's precise entries and rebuild them from its replay buffer."""
        self.counters.resyncs += 1
        self._clear()
        self._last_seq = None
        self._skip_upto = None
        if self.replay_endpoint is None:
            return
        got = await self._replay(0, until_seq, contiguous_from=None)
        if got is not None:
            self._last_seq = got
            if until_seq is None:
                self._skip_upto = got

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.counters.decode_errors += 1
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
            log.warning("kv events %s: sequence went back (%d after %d): engine restarted", self.url, seq, last)
            await self._resync(until_seq=seq)
        elif last is not None and seq > last + 1:
            self.counters.gaps += 1
            log.warning("kv events %s: missed batches %d..%d", self.url, last + 1, seq - 1)
            if self.replay_endpoint is None:
                self.counters.resyncs += 1
                self._clear()
            else:
                await self._replay(last + 1, seq, contiguous_from=last + 1)
        self._apply(seq, payload)

    async def _replay(self, start: int, until_seq: int | None, contiguous_from: int | None) -> int | None:
        """Ask the replay socket for batches from ``start``; apply those before ``until_seq``.

        If the buffer no longer reaches back to ``contiguous_from`` (or the replay fails), the
        current entries cannot be trusted: drop them, then apply what the buffer has. Returns the
        last sequence number applied (-1 for an empty buffer), or None when the replay failed.
        """
        assert self._ctx is not None and self.replay_endpoint is not None
        self.counters.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        last: int | None = None
        first = True
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the frames do
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
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    break
                if first:
                    first = False
                    if contiguous_from is not None and seq != contiguous_from:
                        self._replay_fell_short(contiguous_from, seq)
                if until_seq is not None and seq >= until_seq:
                    continue
                self._apply(seq, payload)
                last = seq
        except (TimeoutError, zmq.ZMQError, DecodeError) as err:
            self.counters.replay_failures += 1
            log.warning("kv events %s: replay from %d failed (%r): dropping its entries", self.url, start, err)
            self.counters.resyncs += 1
            self._clear()
            return None
        finally:
            dealer.close(linger=0)
        if first and contiguous_from is not None and until_seq is not None:
            self._replay_fell_short(contiguous_from, None)  # empty buffer yet a gap: lost
        return last if last is not None else (start - 1)

    def _replay_fell_short(self, wanted: int, got: int | None) -> None:
        self.counters.replay_failures += 1
        self.counters.resyncs += 1
        log.warning("kv events %s: replay starts at %s, needed %d: dropping its entries", self.url, got, wanted)
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

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events = decode_batch(payload, self._decoder)
        except DecodeError as err:
            self.counters.decode_errors += 1
            log.warning("kv events %s: undecodable batch %d: %s", self.url, seq, err)
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
            if ev.medium not in (None, MEDIUM_GPU):
                # Another tier's copy (CPU offload, LMCache through the MultiConnector): its stores
                # and removals say nothing about the GPU cache the index stands for.
                c.ignored += 1
                continue
            if isinstance(ev, BlockStored):
                self._stored(ev)
            else:
                self._removed(ev)
        c.events_applied += len(events)
        c.batches_applied += 1
        c.last_seq = self._last_seq = seq
        c.last_event_time = self._clock()
        c.last_batch_ts = ts

    def _stored(self, ev: BlockStored) -> None:
        spec = self.spec
        if spec is not None and ev.block_size and ev.block_size != spec.unit and not self._warned_block_size:
            self._warned_block_size = True
            log.warning(
                "kv events %s: engine block size %d but the gateway hashes %d-token blocks: prefix "
                "matches will miss; fix the model's block_size", self.url, ev.block_size, spec.unit,
            )
        if not self.translate:
            self.index.stored(self.url, ev.block_hashes)
            return
        assert spec is not None
        if (ev.extra_keys and any(k is not None for k in ev.extra_keys)) or ev.block_size != spec.unit:
            self.counters.untranslatable += 1
            return
        parent: Digest | None = None
        if ev.parent_block_hash is not None:
            parent = self._xlate.get(ev.parent_block_hash)
            if parent is None:  # its parent was stored before we listened, or evicted
                self.counters.untranslatable += 1
                return
        digests = block_digests(ev.token_ids, spec, parent=parent)
        if len(digests) != len(ev.block_hashes):
            self.counters.untranslatable += 1
            return
        xlate = self._xlate
        for engine_hash, digest in zip(ev.block_hashes, digests, strict=True):
            xlate[engine_hash] = digest  # the most recent; evicts the least recently used past the bound
        self.index.stored(self.url, [spec.external(d) for d in digests])

    def _removed(self, ev: BlockRemoved) -> None:
        if not self.translate:
            self.index.removed(self.url, ev.block_hashes)
            return
        assert self.spec is not None
        gone = [self._xlate.pop(h, None) for h in ev.block_hashes]
        self.index.removed(self.url, [self.spec.external(d) for d in gone if d is not None])
