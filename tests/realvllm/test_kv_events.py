"""The gateway's block hashes and KV event handling against a REAL vLLM 0.32 CPU engine.

One engine with ``--enable-prefix-caching`` and ``--kv-events-config`` (ZMQ publisher + replay
socket on free ports), ``PYTHONHASHSEED`` set, no NIXL. Prompts go in as token ids, so what is
hashed is exactly what the engine sees. The proof:

- ``block_hashes(prompt, spec)`` equals the hashes in the engine's own ``BlockStored`` events
  (raw, read off the wire with a plain SUB socket), block for block, with the events' token ids
  and parent chain agreeing; also with a ``cache_salt``;
- ``KVEventSubscriber`` + ``PrefixIndex.match`` say the engine holds the prompt's leading blocks
  (and only the shared ones of a prompt that diverges);
- resetting the engine's prefix cache (AllBlocksCleared) empties its entries, and an engine
  restart behind the same addresses is noticed (reconnect) and its old blocks dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.kvevents import KVEventSubscriber
from policies.beliefs.blockhash import HashSpec, block_hashes
from policies.beliefs.prefix_index import PrefixIndex
from tests.procs import ProcGroup, free_port
from tests.promtext import sample

from . import engines as E

pytestmark = [pytest.mark.realvllm, pytest.mark.e2e]

SEED = "1234"  # the engine's PYTHONHASHSEED: the NONE_HASH seed
TOPIC = "kv@tiny"


@dataclass
class KVEngine:
    engine: E.Engine
    pub_port: int
    replay_port: int
    block_size: int
    group: ProcGroup
    venv: Path
    model_dir: Path
    work: Path

    @property
    def pub(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def spec(self) -> HashSpec:
        return HashSpec(block_size=self.block_size, algo="sha256", seed=SEED)


def _start(
    group: ProcGroup, venv: Path, model_dir: Path, work: Path, role: str, pub: int, replay: int, port: int | None = None
) -> E.Engine:
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": TOPIC,
        # "*" makes vLLM bind (a host address would make it connect); the test connects to 127.0.0.1
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return E.start_engine(
        group,
        role,
        venv,
        model_dir,
        work,
        E.engine_cores()[0],
        nixl=False,
        port=port,
        extra_args=["--enable-prefix-caching", "--kv-events-config", json.dumps(cfg)],
        extra_env={"PYTHONHASHSEED": SEED, "VLLM_SERVER_DEV_MODE": "1"},  # dev mode: /reset_prefix_cache
    )


@pytest.fixture(scope="module")
def kv_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVEngine]:
    venv, model_dir = E.venv_and_model()
    work = tmp_path_factory.mktemp("realvllm-kv")
    group = ProcGroup(work)  # stops every engine by PID (process group), also on failure
    engine = None
    try:
        pub, replay = free_port(), free_port()
        engine = _start(group, venv, model_dir, work, "kv", pub, replay)
        failure = None
        try:
            E.wait_ready([engine])
        except E.SetupError as err:
            failure = str(err)
        if failure:
            pytest.fail(f"real vLLM engine did not start: {failure}", pytrace=False)
        families = text_string_to_metric_families(engine.metrics())
        info = [s.labels for f in families for s in f.samples if s.name == "vllm:cache_config_info"]
        assert info, "vllm:cache_config_info missing"
        assert info[0].get("enable_prefix_caching") in (None, "True")
        assert info[0].get("prefix_caching_hash_algo") in (None, "sha256")
        yield KVEngine(engine, pub, replay, int(info[0]["block_size"]), group, venv, model_dir, work)
    finally:
        group.stop_all()
        if engine is not None:
            engine.http.close()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


async def _complete(eng: E.Engine, prompt: list[int], **extra: Any) -> None:
    body = {"model": E.MODEL_NAME, "prompt": prompt, "max_tokens": 1, **extra}
    async with httpx.AsyncClient(timeout=E.REQUEST_TIMEOUT_S) as http:
        r = await http.post(eng.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def _until(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


class RawFeed:
    """Every batch the engine publishes, decoded without the gateway's code (a second opinion)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(address)
        self.frames: list[tuple[bytes, int, Any]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            topic, seq, payload = await self.sock.recv_multipart()
            self.frames.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))

    def stored(self) -> list[dict]:
        return [ev for _, _, batch in self.frames for ev in batch[1] if ev["type"] == "BlockStored"]

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


@pytest.fixture
async def feeds(kv_engine: KVEngine) -> AsyncIterator[tuple[RawFeed, KVEventSubscriber, PrefixIndex]]:
    ctx = zmq.asyncio.Context()
    index = PrefixIndex(young_s=0.0)
    sub = KVEventSubscriber(
        kv_engine.engine.url,
        kv_engine.pub,
        index=index,
        replay_endpoint=kv_engine.replay,
        topic=TOPIC,
        spec=kv_engine.spec,
        context=ctx,
    )
    raw = RawFeed(ctx, kv_engine.pub)
    await sub.start()
    try:
        assert await _until(lambda: sub.counters.connected), "never connected to the engine's publisher"
        await asyncio.sleep(0.5)  # both subscriptions reach the engine's PUB socket
        yield raw, sub, index
    finally:
        await raw.close()
        await sub.stop()
        ctx.destroy(linger=0)


def _chain(events: list[dict]) -> tuple[list[Any], list[int]]:
    """Follow BlockStored events from the root (parent None) along parent links: hashes, tokens."""
    hashes: list[Any] = []
    tokens: list[int] = []
    parent = None
    while True:
        nxt = [e for e in events if e["parent_block_hash"] == parent and e["block_hashes"][0] not in hashes]
        if not nxt:
            return hashes, tokens
        ev = nxt[0]
        hashes += ev["block_hashes"]
        tokens += ev["token_ids"]
        parent = ev["block_hashes"][-1]


async def test_block_hashes_equal_the_engines(kv_engine: KVEngine, feeds) -> None:
    raw, sub, index = feeds
    bs = kv_engine.block_size
    prompt = _prompt(5 * bs + bs // 2, seed=1)  # 5 full blocks; the answer token fills no 6th
    ours = block_hashes(prompt, kv_engine.spec)
    assert len(ours) == 5
    await _complete(kv_engine.engine, prompt)
    assert await _until(lambda: len(raw.stored()) >= 1 and sub.counters.last_seq is not None)
    assert await _until(lambda: sum(len(e["block_hashes"]) for e in raw.stored()) >= 5)
    events = raw.stored()
    assert all(isinstance(h, int) for e in events for h in e["block_hashes"])  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    assert all(e["block_size"] == bs and e["medium"] == "GPU" for e in events)
    theirs, tokens = _chain(events)
    assert theirs[:5] == ours, f"engine {theirs[:5]} != gateway {ours}"
    assert tokens[: 5 * bs] == prompt[: 5 * bs]
    # the subscriber put them in the index: the engine holds all five leading blocks
    assert await _until(lambda: index.match(ours) == {kv_engine.engine.url: 5})
    assert sub.counters.decode_errors == 0


async def test_match_stops_where_a_prompt_diverges(kv_engine: KVEngine, feeds) -> None:
    _raw, _sub, index = feeds
    bs = kv_engine.block_size
    base = _prompt(4 * bs + 10, seed=2)
    await _complete(kv_engine.engine, base)
    base_hashes = block_hashes(base, kv_engine.spec)
    url = kv_engine.engine.url
    assert await _until(lambda: index.match(base_hashes) == {url: 4})
    fork = base[: 2 * bs] + _prompt(3 * bs, seed=3)  # shares two blocks, then differs
    fork_hashes = block_hashes(fork, kv_engine.spec)
    assert index.match(fork_hashes) == {url: 2}
    hits_before = sample(kv_engine.engine.metrics(), "vllm:prefix_cache_hits_total")
    await _complete(kv_engine.engine, fork)
    assert await _until(lambda: index.match(fork_hashes) == {url: 5})
    # the engine agrees it had exactly those two blocks cached
    assert await _until(
        lambda: sample(kv_engine.engine.metrics(), "vllm:prefix_cache_hits_total") == hits_before + 2 * bs
    )


async def test_cache_salt_hashes(kv_engine: KVEngine, feeds) -> None:
    raw, _sub, index = feeds
    bs = kv_engine.block_size
    prompt = _prompt(3 * bs + 5, seed=4)
    salted = block_hashes(prompt, kv_engine.spec, cache_salt="tenant-a")
    assert salted != block_hashes(prompt, kv_engine.spec)
    await _complete(kv_engine.engine, prompt, cache_salt="tenant-a")
    assert await _until(lambda: index.match(salted) == {kv_engine.engine.url: 3})
    ev = next(e for e in raw.stored() if e["block_hashes"][0] == salted[0])
    assert ev["extra_keys"][0] == ["tenant-a"]  # published untagged, hashed tagged


async def test_reset_prefix_cache_clears(kv_engine: KVEngine, feeds) -> None:
    _raw, sub, index = feeds
    bs = kv_engine.block_size
    prompt = _prompt(2 * bs + 1, seed=5)
    hashes = block_hashes(prompt, kv_engine.spec)
    await _complete(kv_engine.engine, prompt)
    assert await _until(lambda: index.match(hashes) == {kv_engine.engine.url: 2})
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(kv_engine.engine.url + "/reset_prefix_cache")
    assert r.status_code == 200, r.text
    # The engine queues AllBlocksCleared and publishes it with its next scheduler step's events.
    await _complete(kv_engine.engine, _prompt(bs // 2, seed=8))  # under one block: stores nothing
    assert await _until(lambda: sub.counters.cleared_events >= 1)
    assert index.match(hashes) == {}
    assert index.stats().precise_by_url.get(kv_engine.engine.url, 0) == 0


async def test_engine_restart_is_noticed(kv_engine: KVEngine, feeds) -> None:
    """Last in the module: it replaces the engine (same HTTP port and event addresses)."""
    _raw, sub, index = feeds
    bs = kv_engine.block_size
    url = kv_engine.engine.url
    old = block_hashes(_prompt(2 * bs + 3, seed=6), kv_engine.spec)
    await _complete(kv_engine.engine, _prompt(2 * bs + 3, seed=6))
    assert await _until(lambda: index.match(old) == {url: 2})
    kv_engine.engine.proc.stop()
    kv_engine.engine.http.close()
    assert await _until(lambda: not sub.counters.connected, timeout=30), "the subscriber never saw the engine go"
    assert not index.is_precise(url)
    kv_engine.engine = _start(
        kv_engine.group,
        kv_engine.venv,
        kv_engine.model_dir,
        kv_engine.work,
        "kv-restarted",
        kv_engine.pub_port,
        kv_engine.replay_port,
        port=kv_engine.engine.port,
    )
    await asyncio.to_thread(E.wait_ready, [kv_engine.engine])
    assert await _until(lambda: sub.counters.connected and sub.counters.reconnects == 1, timeout=60)
    assert await _until(lambda: index.match(old) == {})  # a new process: its cache starts empty
    new_prompt = _prompt(3 * bs + 3, seed=7)
    new = block_hashes(new_prompt, kv_engine.spec)
    await asyncio.sleep(0.5)
    await _complete(kv_engine.engine, new_prompt)
    assert await _until(lambda: index.match(new) == {url: 3})
    assert index.is_precise(url)
