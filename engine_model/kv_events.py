"""vLLM 0.32's KV cache events: ``--kv-events-config``, the wire structs and the ZMQ publisher.

Wire format (what a consumer of a real engine sees, reproduced field for field):

* PUB socket, one multipart message per engine step that changed the prefix cache:
  ``(topic, sequence as 8-byte big-endian unsigned, msgpack payload)``; sequence numbers
  start at 0 and grow by one per message.
* The payload is a ``KVEventBatch`` encoded by msgspec: the batch is *array-like*
  ``[ts, events, data_parallel_rank]`` (``ts`` = ``time.time()`` of the step); each event is a
  *tagged map* ``{"type": "BlockStored", ...}`` with fields that still hold their default
  left out (msgspec's ``omit_defaults``).
* Optional ROUTER replay socket: a client (DEALER or REQ) sends the first sequence number it
  wants as 8 bytes big-endian; the engine answers with one message per buffered batch from
  that number on, ``(topic, seq, payload)`` after the ROUTER envelope, then the end marker
  ``(b"", -1 as 8-byte signed big-endian, b"")``. The buffer keeps the last ``buffer_steps``
  batches.

Like vLLM the sockets live on a dedicated thread fed by a queue, so the engine loop never
blocks on ZMQ. Block hashes are published as vLLM does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits of the digest as an int;
with the variable at 0, the raw digest bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgspec

log = logging.getLogger("engine_model.kv_events")


class EventSink(Protocol):
    """Where the engine hands each step's events (the ZMQ publisher, or a test's recorder)."""

    def publish(self, events: list[Any]) -> None: ...


# vllm/distributed/kv_events.py:51-53 (media) and vllm/v1/kv_offload/base.py:54-58 (localities).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

ExternalBlockHash = bytes | int


# --------------------------------------------------------------------------- wire structs
# Field names, order, defaults and struct options are vLLM 0.32's (vllm/distributed/kv_events.py):
# they *are* the wire format, so they must not drift.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (``{"type": <class name>, ...}`` on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --------------------------------------------------------------------------- config
@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``): same fields, defaults
    and rule for ``publisher`` (``zmq`` when events are enabled, else ``null``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer")

    @property
    def active(self) -> bool:
        """Events are produced and published (vLLM: otherwise a NullEventPublisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; unknown keys are errors, as in vLLM."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys: {', '.join(unknown)}")
        return cls(**data)


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# --------------------------------------------------------------------------- publisher
class ZmqEventPublisher:
    """PUB + optional ROUTER replay on a thread of their own (vLLM's ``ZmqEventPublisher``).

    ``publish`` only enqueues, so the asyncio loop never waits on a socket. Deviation:
    ``tcp://*:0`` binds ``bind_host`` on a free port (vLLM binds the node IP); the bound
    endpoints are in :attr:`endpoint` / :attr:`replay_endpoint` once :meth:`start` returns.
    """

    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, cfg: KVEventsConfig, bind_host: str = "127.0.0.1", data_parallel_rank: int = 0) -> None:
        self.cfg = cfg
        self.bind_host = bind_host
        self.data_parallel_rank = data_parallel_rank
        self.endpoint: str = cfg.endpoint
        self.replay_endpoint: str | None = cfg.replay_endpoint
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode("utf-8")
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.published = 0  # messages sent on the PUB socket
        self.dropped = 0  # batches lost to a full queue

    def start(self) -> None:
        """Open the sockets (on the publisher thread) and wait until they are bound."""
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"KV events publisher failed to start: {self._error}") from self._error

    def publish(self, events: list[Any]) -> None:
        """Queue one batch (one engine step's events); never blocks."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            log.warning("KV events queue is full (%d batches): dropping one", self.cfg.max_queue_size)

    def shutdown(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(self.SHUTDOWN_TIMEOUT * 2)
        self._thread = None

    # ---------------------------------------------------------------- thread side
    def _bind(self, sock: Any, endpoint: str) -> str:
        import zmq

        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            host = endpoint[len("tcp://") : -2]
            host = self.bind_host if host in ("*", "") else host
            sock.bind(f"tcp://{host}:0")
            bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            return bound
        sock.bind(endpoint)
        return endpoint

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self.cfg.hwm)
            if _is_bind_endpoint(self.endpoint):
                self.endpoint = self._bind(pub, self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._bind(replay, self.replay_endpoint)
        except Exception as e:  # reported to start()
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    try:
                        self._serve_replay(replay)
                    except Exception:
                        log.exception("KV events replay failed")
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encoder.encode(batch)
                try:
                    pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except Exception:
                    log.exception("KV events publish failed")
                    time.sleep(0.1)
                    continue
                self._buffer.append((seq, payload))
                self.published += 1
                seq += 1
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()

    def _serve_replay(self, sock: Any) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3:
            log.warning("Invalid replay request: %s", frames)
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                sock.send_multipart((client_id, b"", self._topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client_id, b"", b"", END_SEQ, b""))
