"""KVEventSubscriber against a real ZMQ PUB + ROUTER pair on loopback speaking vLLM 0.32's
KV-event protocol: live events, gaps filled by replay, buffers that no longer reach back, engine
restarts, reconnects, and hash translation for engines whose hashes cannot be reproduced. Then
what a broken or forged feed may make the gateway do (issue 27): bounded messages, batches and
replays, work in slices, and one log line per interval."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.engines import kvevents
from gateway.engines.kvevents import KVEventSubscriber
from gateway.engines.kvwire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    FeedLimits,
    decode_batch,
)
from policies.beliefs.blockhash import HashSpec, block_hashes
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.tiers import TierIndex
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
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" or "REMOTE" relative to the publisher


class WireRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class WireCleared(_Event, tag="AllBlocksCleared"):
    pass


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[WireStored | WireRemoved | WireCleared]
    data_parallel_rank: int | None = None


def stored(
    hashes: list[Any], tokens: list[int] | None = None, parent: Any = None, bs: int = 4, **kw: Any
) -> WireStored:
    kw.setdefault("group_idx", 0)
    return WireStored(
        hashes, parent, tokens if tokens is not None else [0] * (bs * len(hashes)), bs, None, "GPU", None, **kw
    )


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
        URL,
        f"tcp://127.0.0.1:{ports[0]}",
        index=index,
        replay_endpoint=f"tcp://127.0.0.1:{ports[1]}" if replay else None,
        topic=TOPIC,
        heartbeat_s=0.5,
        reconnect_ivl_s=0.05,
        reconnect_ivl_max_s=0.2,
        replay_timeout_s=2.0,
        **kw,
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
    raw = [
        2.0,
        [
            ["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None, "GPU"],
            ["BlockRemoved", [5], "GPU"],
            ["AllBlocksCleared"],
            {"type": "SomethingNew"},
        ],
    ]
    _, events = decode_batch(msgspec.msgpack.encode(raw))
    assert events == [
        BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None),
        BlockRemoved([5], "GPU"),
        AllBlocksCleared(),
    ]
    for bad in (
        b"\xc1",
        msgspec.msgpack.encode({"x": 1}),
        msgspec.msgpack.encode([1.0, [7]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
    ):
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
    sub = KVEventSubscriber(
        URL, f"tcp://127.0.0.1:{ports[0]}", index=index, replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", topic=TOPIC
    )
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


async def test_with_tiers_on_other_tiers_events_feed_the_tier_beliefs(
    ctx: zmq.asyncio.Context, ports: tuple[int, int]
) -> None:
    """A CPU-medium store local to the engine is its L1; one whose locality is REMOTE is the shared
    L2, which any engine can load from; removals take them out; the GPU view stays as it is."""
    tiers = TierIndex(l1_capacity=lambda url: 100, l2_capacity=100)
    spec = HashSpec(block_size=4, algo="sha256", seed="0")  # reproducible: the engine's hashes are ours
    engine, sub, index = await connected_pair(ctx, ports, tiers=tiers, spec=spec)
    try:
        await engine.publish(stored([1, 2]))
        await engine.publish(WireStored([3, 4], None, [0] * 8, 4, None, "CPU", None, group_idx=0, locality="LOCAL"))
        await engine.publish(WireStored([5], None, [0] * 4, 4, None, "CPU", None, group_idx=0, locality="REMOTE"))
        await until(lambda: sub.counters.tier_events == 2)
        assert index.match([1, 2, 3]) == {URL: 2}  # the GPU holds 1, 2 only
        assert tiers.walk(URL, [1, 2, 3, 4, 5, 6], 2) == (2, 1)
        assert tiers.walk("http://other:8000", [5], 0) == (0, 1)  # the shared store, for any engine
        await engine.publish(WireRemoved([4], "CPU", 0, "LOCAL"))
        await until(lambda: sub.counters.tier_events == 3)
        assert tiers.walk(URL, [1, 2, 3, 4, 5], 2) == (1, 0)
        # LMCache and Mooncake write the medium in lower case; LMCache keys 256-token chunks by hashes
        # of its own, which no prompt's blocks match: counted, not believed.
        await engine.publish(WireStored([6], None, [0] * 4, 4, None, "cpu", None, group_idx=0))
        await engine.publish(WireStored([99], None, [0] * 256, 256, None, "cpu", None, group_idx=0))
        await until(lambda: sub.counters.tier_events == 4 and sub.counters.untranslatable == 1)
        assert tiers.walk(URL, [1, 2, 3, 4], 2) == (1, 0) and tiers.walk(URL, [6], 0) == (1, 0)
        assert index.match([6]) == {}  # nothing of it reached the GPU view
    finally:
        await sub.stop()
        await engine.close()


async def test_translations_are_a_bounded_lru() -> None:
    """The engine-hash map is LRU-bounded by ``max_translations``: a parent looked up counts as a
    use, the least recently used translation goes first, and a clear starts a fresh map."""
    spec = HashSpec(block_size=4, algo="xxhash", seed=None)
    index = PrefixIndex()
    index.set_precise(URL, True)
    sub = KVEventSubscriber(URL, "tcp://127.0.0.1:1", index=index, spec=spec, max_translations=3)
    a, b, c, d, e = ([i] * 4 for i in range(1, 6))

    async def store(engine_hash: int, tokens: list[int], parent: int | None = None) -> None:
        await sub._stored(BlockStored([engine_hash], parent, tokens, 4))

    await store(901, a)
    await store(902, b)
    await store(903, c, parent=901)  # 901 used as a parent: now more recent than 902
    await store(904, d)  # past the bound: 902, the least recently used, is dropped
    assert set(sub._xlate) == {901, 903, 904}
    await store(905, e, parent=901)  # still translatable
    assert sub.counters.untranslatable == 0
    await store(906, a, parent=902)  # its parent's translation is gone
    assert sub.counters.untranslatable == 1
    await sub._removed(BlockRemoved([905]))
    assert index.match(block_hashes(a + e, spec)) == {URL: 1}  # a stays; a+e was removed
    sub._clear()
    assert len(sub._xlate) == 0 and sub._xlate.maxsize == 3


# -- a broken or forged feed (issue 27, point 5) ---------------------------------------------------


def encode(*events: Any) -> bytes:
    return msgspec.msgpack.encode(WireBatch(1.0, list(events), 0))


def test_a_batch_over_the_block_bound_is_refused_before_its_hashes_are_built() -> None:
    dec = BatchDecoder(max_blocks=10, tokens_per_block=4)
    _, events = dec.decode(encode(stored(list(range(6))), removed(list(range(4)))))  # 10: at the bound
    assert [len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared)] == [6, 4]
    for payload, why in [
        (encode(stored(list(range(11)), tokens=[])), "block_hashes"),  # one event over it: its list header says so
        (encode(stored(list(range(6)), tokens=[]), removed(list(range(5)))), "more than 10 block hashes"),  # in all
        (encode(*[WireCleared()] * 11), "events"),  # events are bounded too
        (encode(stored(list(range(3)), tokens=list(range(41)))), "token_ids"),  # token ids per block
        (encode(stored(["a"])), "block_hashes"),  # not hashes
        (encode(stored([b"x" * 65])), "block_hashes"),  # a hash is a digest, not a megabyte
        (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": [0] * 9}]]), "medium"),
    ]:
        with pytest.raises(DecodeError, match=why):
            dec.decode(payload)
    # A million hashes cost a header read: the error names the bound, nothing was built.
    with pytest.raises(DecodeError, match="length <= 10"):
        dec.decode(encode(stored(list(range(1_000_000)), tokens=[])))


def test_token_ids_are_decoded_only_for_translation() -> None:
    payload = encode(stored([1, 2], extra_keys=[["salt"], None]))
    _, (ev,) = BatchDecoder(tokens_per_block=None).decode(payload)
    assert isinstance(ev, BlockStored) and ev.token_ids == [] and ev.extra_keys is None
    _, (ev,) = BatchDecoder(tokens_per_block=4).decode(payload)
    assert isinstance(ev, BlockStored) and ev.token_ids == [0] * 8 and ev.extra_keys == [["salt"], None]


async def test_a_message_over_the_size_bound_drops_the_connection_then_the_feed_comes_back(
    ctx: zmq.asyncio.Context, ports: tuple[int, int]
) -> None:
    """ZMQ_MAXMSGSIZE: ZMQ ends the connection on reading the size, and does not reconnect after
    such a protocol error by itself: the subscriber does."""
    limit = 64 * 1024
    engine, sub, index = await connected_pair(ctx, ports, limits=FeedLimits(max_message_bytes=limit))
    try:
        await engine.publish(stored([1, 2]))
        await until(lambda: index.match([1, 2]) == {URL: 2})
        await engine.publish(stored(list(range(2**40, 2**40 + limit // 8)), tokens=[]))  # 9 bytes a hash: over it
        await until(lambda: sub.counters.disconnects == 1)
        assert not index.is_precise(URL)
        await engine.subscribed(timeout=10)  # it connected again and subscribed
        await until(lambda: sub.counters.connects == 2)
        await engine.publish(stored([7]))
        await until(lambda: index.match([7]) == {URL: 1})
        assert index.match([2**40]) == {}  # the large batch never reached the index
    finally:
        await sub.stop()
        await engine.close()


async def test_a_refused_batch_drops_the_engines_entries(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    """A batch over the bound took a sequence number: what it held (removals, perhaps) is lost, as
    with a gap the replay cannot fill."""
    engine, sub, index = await connected_pair(ctx, ports, limits=FeedLimits(max_batch_blocks=100))
    try:
        await engine.publish(stored([1, 2]))
        await until(lambda: index.match([1, 2]) == {URL: 2})
        await engine.publish(stored(list(range(1000, 1101))), removed([1]))
        await until(lambda: sub.counters.decode_errors == 1)
        assert index.match([1]) == {} and index.stats().precise == 0
        await engine.publish(stored([3]))
        await until(lambda: index.match([3]) == {URL: 1})
        assert sub.counters.gaps == 0  # the refused batch's sequence number counts as seen
    finally:
        await sub.stop()
        await engine.close()


DEEP = msgspec.Raw(b"\x91" * 5000 + b"\xc0")  # [[[...[nil]...]]] 5000 deep: past the interpreter's recursion limit


def test_nesting_past_the_recursion_limit_is_a_decode_error() -> None:
    """msgspec raises RecursionError for such nesting, even in a field left raw: a malformed
    batch like any other, not an exception the subscriber does not expect."""
    dec = BatchDecoder(tokens_per_block=4)
    for payload in [
        DEEP,  # the whole payload
        msgspec.msgpack.encode([DEEP, []]),  # ts
        msgspec.msgpack.encode([1.0, [{"type": "Unknown", "x": DEEP}]]),  # a field of an unknown event
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "extra_keys": DEEP}]]),
    ]:
        with pytest.raises(DecodeError):
            dec.decode(payload)


async def test_a_deeply_nested_batch_is_refused_and_the_feed_goes_on(
    ctx: zmq.asyncio.Context, ports: tuple[int, int]
) -> None:
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await engine.publish(stored([1, 2]))
        await until(lambda: index.match([1, 2]) == {URL: 2})
        replays = list(engine.replay_requests)  # the connect's
        bad = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}, {"type": "X", "x": DEEP}]])
        await engine.pub.send_multipart([TOPIC.encode(), (1).to_bytes(8, "big"), bad])
        engine.seq = 2
        await until(lambda: sub.counters.decode_errors == 1)
        assert index.stats().precise == 0  # refused: its removals may be lost, so the entries go
        await engine.publish(stored([3]))
        await until(lambda: index.match([3]) == {URL: 1})
        assert sub.counters.gaps == 0 and engine.replay_requests == replays  # its number counts as seen
    finally:
        await sub.stop()
        await engine.close()


async def test_a_large_batch_is_applied_in_slices(
    ctx: zmq.asyncio.Context, ports: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other tasks run while a batch is applied: they see it half applied (slices made tiny here)."""
    monkeypatch.setattr(kvevents, "SLICE_S", 0.0)
    monkeypatch.setattr(kvevents, "CHUNK_BLOCKS", 100)
    engine, sub, index = await connected_pair(ctx, ports)
    seen: set[int] = set()
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            seen.add(index.stats().precise)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await engine.publish(stored(list(range(1, 1001))))
        await until(lambda: index.stats().precise == 1000)
        assert any(0 < n < 1000 for n in seen), sorted(seen)
    finally:
        done.set()
        await watcher
        await sub.stop()
        await engine.close()


async def test_garbage_is_counted_and_logged_once_per_interval(
    ctx: zmq.asyncio.Context, ports: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engines.kvevents")
    engine, sub, index = await connected_pair(ctx, ports, log_interval_s=0.5)
    try:
        caplog.clear()
        seq = 0
        for n in range(300):
            await engine.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), b"\xc1" * (n + 1)])
            await engine.pub.send_multipart([TOPIC.encode(), b"\x01" * 4096, b"\x90"])  # a 4 KB sequence number
            await engine.pub.send_multipart([TOPIC.encode() + b"x"])  # one frame
            seq += 1
        engine.seq = seq
        await engine.publish(stored([5]))
        await until(lambda: index.match([5]) == {URL: 1})
        assert sub.counters.decode_errors == 3 * 300  # (the one-frame ones match the SUBSCRIBE prefix)
        await until(lambda: any("in the last" in r.getMessage() for r in caplog.records), timeout=5)
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.engines.kvevents"]
        assert len(lines) <= 3, lines
        told = sum(
            int(m[1])
            if (m := re.search(r"(\d+) malformed in the last", line))
            else "refused" in line or "not (topic" in line
            for line in lines
        )
        assert told == 3 * 300, lines  # each one said, most of them as a count
    finally:
        await sub.stop()
        await engine.close()


async def test_replays_are_rate_limited(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    """A forged "engine restarted" per message must not make the engine replay its buffer per
    message: past the burst, a restart or gap drops the entries instead of asking for a replay."""
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await until(lambda: len(engine.replay_requests) == 1)  # the connect's resync
        t0 = time.monotonic()
        for _ in range(50):
            engine.seq = 0  # the sequence goes back each time: a "new engine process"
            await engine.publish(stored([1]))
        await until(lambda: sub.counters.restarts == 49)
        allowed = kvevents.REPLAY_BURST + (time.monotonic() - t0) / kvevents.REPLAY_EVERY_S + 1
        assert len(engine.replay_requests) <= allowed, (len(engine.replay_requests), allowed)
        assert index.match([1]) == {URL: 1}  # still applied
    finally:
        await sub.stop()
        await engine.close()


async def test_a_hole_in_a_replay_drops_the_entries(ctx: zmq.asyncio.Context, ports: tuple[int, int]) -> None:
    """The engine's ROUTER drops what does not fit the subscriber's queue: a replay missing a batch
    in its middle cannot be trusted up to there."""
    engine, sub, index = await connected_pair(ctx, ports)
    try:
        await engine.publish(stored([1, 2]))
        await until(lambda: index.match([1, 2]) == {URL: 2})
        await engine.publish(stored([3]), send=False)
        await engine.publish(removed([1]), send=False)  # lost on the wire, and (below) in the replay
        await engine.publish(stored([4]), send=False)
        engine.buffer = deque(b for b in engine.buffer if b[0] != 2)
        await engine.publish(stored([5]))
        await until(lambda: sub.counters.last_seq == 4)
        assert sub.counters.replay_failures == 1
        assert index.match([1]) == {} and index.match([2]) == {}  # dropped: the removal of 1 was lost
        assert index.match([4]) == {URL: 1} and index.match([5]) == {URL: 1}  # what came after the hole
    finally:
        await sub.stop()
        await engine.close()


def test_precise_entries_are_cleared_and_evicted_in_bulk() -> None:
    """Each engine's precise entries stand alone: clearing or capping one leaves the others whole."""
    index = PrefixIndex(max_precise_per_url=1000)
    a, b = "http://a", "http://b"
    index.stored(a, range(1500))  # 500 over the cap: the oldest stored go
    index.stored(b, range(10))
    assert index.precise_evicted == 500
    assert index.match(list(range(10))) == {b: 10}  # a no longer holds 0..499
    assert index.match(list(range(500, 510))) == {a: 10}
    index.removed(a, range(500, 505))
    assert index.match(list(range(500, 510))) == {}
    assert index.match(list(range(505, 510))) == {a: 5}
    index.stored(b, range(505, 510))
    index.cleared(a)
    assert index.match(list(range(505, 510))) == {b: 5} and index.stats().precise_by_url == {b: 15}
