"""KVEventSubscriber against a real ZMQ PUB + ROUTER pair on loopback speaking vLLM 0.32's
KV-event protocol: live events, gaps filled by replay, buffers that no longer reach back, engine
restarts, reconnects, and hash translation for engines whose hashes cannot be reproduced."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventSubscriber,
    decode_batch,
)
from policies.blockhash import HashSpec, block_hashes
from policies.prefix_index import PrefixIndex
from tests.procs import free_port
from tests.waiting import until

URL = "http://engine-1:8000"
TOPIC = "kv@engine-1"


# -- vLLM 0.32's wire format, written from its field lists -------------------------------------------

class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class WireStored(_Event, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class WireRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class WireCleared(_Event, tag="AllBlocksCleared"):
    pass


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[WireStored | WireRemoved | WireCleared]
    data_parallel_rank: int | None = None


def stored(hashes: list[Any], tokens: list[int] | None = None, parent: Any = None, bs: int = 4,
           **kw: Any) -> WireStored:
    kw.setdefault("group_idx", 0)
    return WireStored(hashes, parent, tokens if tokens is not None else [0] * (bs * len(hashes)), bs, None, "GPU", None,
                      **kw)


def removed(hashes: list[Any], **kw: Any) -> WireRemoved:
    kw.setdefault("group_idx", 0)
    return WireRemoved(hashes, "GPU", **kw)


class FakeEngine:
    """An engine's ZmqEventPublisher: PUB with (topic, seq, payload), ROUTER replaying its buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_port: int, replay_port: int | None, buffer: int = 10_000) -> None:
        self.ctx = ctx
        self.pub_port, self.replay_port = pub_port, replay_port
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()
        # XPUB: a PUB socket that also tells when a subscriber's subscription has arrived, so tests
        # wait for that instead of sleeping through ZMQ's "slow joiner" window.
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.subscriptions = 0
        self.router: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.replay_requests: list[int] = []
        if replay_port is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.task = asyncio.create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            ident, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([ident, b"", TOPIC.encode(), seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def subscribed(self, timeout: float = 5.0) -> None:
        """Return once a subscriber's subscription has reached this socket (its next
        ``publish`` is delivered)."""
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.pub.recv()
                if frame[:1] == b"\x01":  # subscribe (\x00 would be unsubscribe)
                    self.subscriptions += 1
                    return

    async def publish(self, *events: Any, send: bool = True) -> int:
        """One batch; ``send=False`` keeps it out of the live feed (a lost message) but buffered."""
        seq = self.seq
        self.seq += 1
        payload = self.enc.encode(WireBatch(time.time(), list(events), 0))
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


async def connected_pair(
    ctx: zmq.asyncio.Context, ports: tuple[int, int], *, replay: bool = True, **kw: Any
) -> tuple[FakeEngine, KVEventSubscriber, PrefixIndex]:
    engine = FakeEngine(ctx, ports[0], ports[1] if replay else None)
    index = PrefixIndex(young_s=0.0)
    sub = KVEventSubscriber(
        URL, f"tcp://127.0.0.1:{ports[0]}", index=index,
        replay_endpoint=f"tcp://127.0.0.1:{ports[1]}" if replay else None, topic=TOPIC,
        heartbeat_s=0.5, reconnect_ivl_s=0.05, reconnect_ivl_max_s=0.2, replay_timeout_s=2.0, **kw,
    )
    await sub.start()
    await until(lambda: sub.counters.connected)
    await engine.subscribed()
    return engine, sub, index


# -- decoding --------------------------------------------------------------------------------------

def test_decode_vllm_batch() -> None:
    enc = msgspec.msgpack.Encoder()
    payload = enc.encode(WireBatch(1.5, [stored([1, 2], parent=7), removed([3]), WireCleared()], 0))
    ts, events = decode_batch(payload)
    assert ts == 1.5
    assert events == [
        BlockStored([1, 2], 7, [0] * 8, 4, None, "GPU", 0),
        BlockRemoved([3], "GPU", 0),
        AllBlocksCleared(),
    ]
    assert msgspec.msgpack.decode(payload)[1][2] == {"type": "AllBlocksCleared"}  # tagged maps


def test_decode_older_array_events_and_unknown_types() -> None:
    raw = [2.0, [["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None, "GPU"], ["BlockRemoved", [5], "GPU"],
                 ["AllBlocksCleared"], {"type": "SomethingNew"}]]
    _, events = decode_batch(msgspec.msgpack.encode(raw))
    assert events == [BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None), BlockRemoved([5], "GPU"),
                      AllBlocksCleared()]
    for bad in (b"\xc1", msgspec.msgpack.encode({"x": 1}), msgspec.msgpack.encode([1.0, [7]]),
                msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])):
        with pytest.raises(DecodeError):
            decode_batch(bad)


# -- the live feed ---------------------------------------------------------------------------------

async def test_live_events(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        assert index.is_precise(URL)
        await engine.publish(stored([1, 2, 3]))
        await until(lambda: index.match([1, 2, 3]) == {URL: 3})
        await engine.publish(removed([2]))
        await until(lambda: index.match([1, 2, 3]) == {URL: 1})
        await engine.publish(stored([9], group_idx=1))  # another KV cache group: not ours
        await engine.publish(WireCleared())
        await until(lambda: sub.counters.cleared_events == 1)
        assert index.match([1]) == {}
        c = sub.counters
        assert (c.batches_applied, c.events_applied, c.ignored, c.gaps, c.last_seq) == (4, 4, 1, 0, 3)
        assert c.last_event_time is not None and c.last_batch_ts is not None
        await engine.publish(stored([4]))
        await until(lambda: index.match([4]) == {URL: 1})
    finally:
        await sub.stop()
        await engine.close()
    assert index.match([4]) == {} and not index.is_precise(URL)  # stop drops what it can't keep true


async def test_topic_filter(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        payload = msgspec.msgpack.encode(WireBatch(1.0, [stored([5])]))
        await engine.pub.send_multipart([(TOPIC + "-other").encode(), (0).to_bytes(8, "big"), payload])
        await engine.publish(stored([6]))
        await until(lambda: index.match([6]) == {URL: 1})
        assert index.match([5]) == {}
    finally:
        await sub.stop()
        await engine.close()


async def test_gap_filled_by_replay(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await engine.publish(stored([1, 2]))
        await engine.publish(stored([3]), send=False)  # lost on the wire
        await engine.publish(removed([1]), send=False)
        await engine.publish(stored([4]))
        await until(lambda: sub.counters.last_seq == 3)
        assert index.stats().precise_by_url == {URL: 3}  # 2, 3, 4
        assert index.match([1]) == {}  # the lost removal was replayed
        assert sub.counters.gaps == 1 and sub.counters.replay_failures == 0
        assert engine.replay_requests[-1] == 1
    finally:
        await sub.stop()
        await engine.close()


async def test_gap_beyond_the_replay_buffer(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    engine.buffer = deque(maxlen=2)
    try:
        await engine.publish(stored([1]))
        await until(lambda: index.match([1]) == {URL: 1})
        await engine.publish(removed([1]), send=False)  # falls out of the 2-batch buffer
        await engine.publish(stored([7]), send=False)
        await engine.publish(stored([8]))
        await until(lambda: sub.counters.last_seq == 3)
        assert sub.counters.replay_failures == 1
        assert index.stats().precise_by_url == {URL: 2}  # rebuilt from what the buffer had: 7, 8
    finally:
        await sub.stop()
        await engine.close()


async def test_gap_without_replay_drops_entries(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports, replay=False)
    try:
        await engine.publish(stored([1]))
        await until(lambda: index.match([1]) == {URL: 1})
        await engine.publish(removed([1]), send=False)
        await engine.publish(stored([2]))
        await until(lambda: sub.counters.last_seq == 2)
        assert sub.counters.gaps == 1
        assert index.stats().precise_by_url == {URL: 1}  # only what came after the gap
    finally:
        await sub.stop()
        await engine.close()


async def test_history_is_replayed_on_connect(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine = FakeEngine(ctx, ports[0], ports[1])
    for h in (1, 2, 3):
        await engine.publish(stored([h]), send=False)  # before the gateway listened
    await engine.publish(removed([2]), send=False)
    index = PrefixIndex()
    sub = KVEventSubscriber(URL, f"tcp://127.0.0.1:{ports[0]}", index=index,
                            replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", topic=TOPIC)
    await sub.start()
    try:
        await until(lambda: sub.counters.last_seq == 3)
        assert index.stats().precise_by_url == {URL: 2}
        await engine.subscribed()
        await engine.publish(stored([5]))
        await until(lambda: sub.counters.last_seq == 4)
        assert sub.counters.gaps == 0 and engine.replay_requests == [0]
    finally:
        await sub.stop()
        await engine.close()


async def test_sequence_going_back_is_a_restart(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        for h in (1, 2, 3):
            await engine.publish(stored([h]))
        await until(lambda: sub.counters.last_seq == 2)
        # a new engine process behind the same sockets: sequence from 0, an empty cache
        engine.seq, engine.buffer = 0, deque(maxlen=10_000)
        await engine.publish(stored([10]))
        await until(lambda: index.match([10]) == {URL: 1})
        assert sub.counters.restarts == 1
        assert index.stats().precise_by_url == {URL: 1}
    finally:
        await sub.stop()
        await engine.close()


async def test_reconnect_after_engine_restart(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        for h in (1, 2, 3, 4):
            await engine.publish(stored([h]))
        await until(lambda: sub.counters.last_seq == 3)
        await engine.close()  # the engine goes away
        await until(lambda: not sub.counters.connected)
        assert not index.is_precise(URL)
        engine = FakeEngine(ctx, *ports)  # back, a new process with an empty cache
        await engine.publish(stored([20]), send=False)  # published before we reconnected
        await until(lambda: sub.counters.connected, timeout=10)
        await until(lambda: index.match([20]) == {URL: 1})
        assert index.match([1]) == {}  # the old process's blocks are gone
        assert index.is_precise(URL)
        assert sub.counters.reconnects == 1 and sub.counters.disconnects == 1
        await engine.subscribed()
        await engine.publish(stored([21]))
        await until(lambda: index.match([21]) == {URL: 1})
        assert sub.counters.gaps == 0
    finally:
        await sub.stop()
        await engine.close()


async def test_replay_socket_down(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    sub.replay_timeout_s = 0.3
    try:
        await engine.publish(stored([1]))
        await until(lambda: index.match([1]) == {URL: 1})
        assert engine.router is not None and engine.task is not None
        engine.task.cancel()  # the replay socket stops answering
        await engine.publish(removed([1]), send=False)
        await engine.publish(stored([2]))
        await until(lambda: sub.counters.last_seq == 2)
        assert sub.counters.replay_failures == 1
        assert index.stats().precise_by_url == {URL: 1}
    finally:
        await sub.stop()
        await engine.close()


async def test_undecodable_batch_is_counted(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await engine.pub.send_multipart([TOPIC.encode(), (0).to_bytes(8, "big"), b"\xc1"])
        engine.seq = 1
        await engine.publish(stored([3]))
        await until(lambda: index.match([3]) == {URL: 1})
        assert sub.counters.decode_errors == 1 and sub.counters.gaps == 0
    finally:
        await sub.stop()
        await engine.close()


# -- translation (engines whose hashes the gateway cannot reproduce) -------------------------------

async def test_translation_maps_engine_hashes(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    spec = HashSpec(block_size=4, algo="xxhash", seed=None)  # random NONE_HASH in every engine
    assert not spec.reproducible
    engine, sub, index = await connected_pair(ctx, ports, spec=spec)
    assert sub.translate
    prompt = list(range(100, 116))  # 4 blocks
    ours = block_hashes(prompt, spec)
    try:
        # the engine's own (unknowable) hashes: stored in two events, the second chained on the first
        await engine.publish(stored([901, 902], prompt[:8]))
        await engine.publish(stored([903, 904], prompt[8:], parent=902))
        await until(lambda: sub.counters.last_seq == 1)
        assert index.match(ours) == {URL: 4}
        await engine.publish(removed([903]))
        await until(lambda: index.match(ours) == {URL: 2})
        await engine.publish(stored([999], [1, 2, 3, 4], parent=12345))  # parent never seen
        await engine.publish(stored([998], [1, 2, 3, 4], extra_keys=[["salt"]]))  # extra keys
        await until(lambda: sub.counters.untranslatable == 2)
    finally:
        await sub.stop()
        await engine.close()


def test_translation_needs_a_spec() -> None:
    with pytest.raises(ValueError):
        KVEventSubscriber(URL, "tcp://127.0.0.1:1", index=PrefixIndex(), translate=True)


async def test_other_tiers_events_leave_the_gpu_view_alone(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    """With LMCache or CPU offloading behind a MultiConnector, an engine also reports blocks stored
    and evicted in other tiers; only its GPU cache's events move the index."""
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await engine.publish(stored([1, 2]))
        await until(lambda: index.match([1, 2]) == {URL: 2})
        await engine.publish(WireRemoved([2], "CPU", 0))  # evicted from the CPU tier: still on the GPU
        await engine.publish(WireStored([7], None, [0] * 4, 4, None, "CPU", None, group_idx=0))
        await until(lambda: sub.counters.ignored == 2)
        assert index.match([1, 2]) == {URL: 2} and index.match([7]) == {}
    finally:
        await sub.stop()
        await engine.close()


def test_translations_are_a_bounded_lru() -> None:
    """The engine-hash map is LRU-bounded by ``max_translations``: a parent looked up counts as a
    use, the least recently used translation goes first, and a clear starts a fresh map."""
    spec = HashSpec(block_size=4, algo="xxhash", seed=None)
    index = PrefixIndex()
    index.set_precise(URL, True)
    sub = KVEventSubscriber(URL, "tcp://127.0.0.1:1", index=index, spec=spec, max_translations=3)
    a, b, c, d, e = ([i] * 4 for i in range(1, 6))

    def store(engine_hash: int, tokens: list[int], parent: int | None = None) -> None:
        sub._stored(BlockStored([engine_hash], parent, tokens, 4))

    store(901, a)
    store(902, b)
    store(903, c, parent=901)  # 901 used as a parent: now more recent than 902
    store(904, d)  # past the bound: 902, the least recently used, is dropped
    assert set(sub._xlate) == {901, 903, 904}
    store(905, e, parent=901)  # still translatable
    assert sub.counters.untranslatable == 0
    store(906, a, parent=902)  # its parent's translation is gone
    assert sub.counters.untranslatable == 1
    sub._removed(BlockRemoved([905]))
    assert index.match(block_hashes(a + e, spec)) == {URL: 1}  # a stays; a+e was removed
    sub._clear()
    assert len(sub._xlate) == 0 and sub._xlate.maxsize == 3
