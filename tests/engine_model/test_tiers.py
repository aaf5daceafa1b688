"""The KV offload tiers in-process (engine_model/tiers.py, tier_loads.py): what reaches the L1 and
when, what an L1 or L2 hit costs and counts, the events by medium, the L2 shared between engines,
the fleet in virtual time, and an L2 that cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid

import pytest

from engine_model import virtual
from engine_model.config import SimConfig
from engine_model.engine import Engine
from engine_model.fleet import Fleet, Job, Layout, simulate
from engine_model.kv_events import BlockRemoved, BlockStored
from engine_model.l2_redis import RedisL2
from engine_model.metrics import SimMetrics
from engine_model.seq import Collector, Seq
from engine_model.tiers import CpuTier, InProcessL2
from engine_model.tokens import ByteTokenizer
from tests.waiting import until

BS = 16


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events: list) -> None:
        self.batches.append(list(events))

    def events(self) -> list:
        return [e for b in self.batches for e in b]

    def clear(self) -> None:
        self.batches.clear()


@contextlib.asynccontextmanager
async def tiered(l2=None, **kw):
    """A started engine with an L1 (and ``l2``), its events in ``e.rec``."""
    settings = {"block_size": BS, "num_gpu_blocks": 9, "max_model_len": 128, "cpu_blocks": 16, **kw}
    cfg = SimConfig(**settings)
    rec = Recorder()
    e = Engine(cfg, SimMetrics(cfg), ByteTokenizer().output_vocab, publisher=rec, l2=l2)
    e.rec = rec  # type: ignore[attr-defined]
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


async def run(e: Engine, rid: str, prompt: list[int], max_tokens: int = 2) -> Seq:
    seq = Seq(rid, prompt, max_tokens, collector=Collector(1))
    e.submit(seq)
    await asyncio.wait_for(seq.collector.done, 10)
    return seq


def prompt(base: int, n: int = 65) -> list[int]:
    return list(range(base, base + n))  # 65 tokens: 4 full blocks a hit can cover


def by(events: list, kind: type, medium: str) -> list:
    return [e for e in events if isinstance(e, kind) and e.medium == medium]


def hashes(e: Engine, seq: Seq, n: int = 4) -> list[int]:
    assert e.hash_spec is not None
    return [e.hash_spec.external(d) for d in seq.digests[:n]]


def value(lazy) -> float:
    return lazy.child._value.get()


async def flush_gpu(e: Engine, n: int = 2, base: int = 50_000) -> None:
    """Run ``n`` other prompts (4 full blocks each): enough to evict every GPU block of the earlier ones."""
    for i in range(n):
        await run(e, f"flush{i}", prompt(base + i * 1000))


# ------------------------------------------------------------------------------------- L1
async def test_computed_blocks_go_to_the_l1_as_cpu_events_with_vllms_placeholder_payload():
    async with tiered() as e:
        a = await run(e, "a", prompt(1000))
        events = e.rec.events()
        gpu = by(events, BlockStored, "GPU")
        cpu = by(events, BlockStored, "CPU")
        assert [h for ev in gpu for h in ev.block_hashes] == hashes(e, a)
        # One placeholder per block (vLLM's default, offloading/events.py _placeholder_stored), after the GPU's.
        assert [ev.block_hashes for ev in cpu] == [[h] for h in hashes(e, a)]
        assert all(ev.token_ids == [] and ev.block_size == 0 and ev.parent_block_hash is None for ev in cpu)
        assert all(ev.locality is None for ev in cpu)  # the CPU manager sets no locality
        assert events.index(cpu[0]) > events.index(gpu[-1])
        assert e.tier_state()["l1"]["blocks"] == 4


async def test_self_describing_events_carry_tokens_and_parents():
    async with tiered(self_describing_kv_events=True) as e:
        a = await run(e, "a", prompt(1000))
        cpu = by(e.rec.events(), BlockStored, "CPU")
        h = hashes(e, a)
        assert [ev.parent_block_hash for ev in cpu] == [None, *h[:3]]
        assert [ev.token_ids for ev in cpu] == [prompt(1000)[i * BS : (i + 1) * BS] for i in range(4)]
        assert {ev.block_size for ev in cpu} == {BS} and {ev.kv_cache_spec_kind for ev in cpu} == {"full_attention"}


async def test_a_prefix_evicted_from_the_gpu_loads_back_from_the_l1_at_its_cost():
    async with tiered(l1_load_time_per_token=0.002) as e:
        a = await run(e, "a", prompt(1000))
        await flush_gpu(e)
        assert set(hashes(e, a)) <= {h for ev in by(e.rec.events(), BlockRemoved, "GPU") for h in ev.block_hashes}
        e.rec.clear()
        m = e.m
        m.flush()
        hits0, ext0 = value(m.prefix_hits), value(m.ext_prefix_hits)
        again = await run(e, "a2", prompt(1000))
        assert again.first_token_t - again.arrival >= 64 * 0.002  # 64 tokens copied host -> GPU
        assert again.local_hit == 0 and again.external_tokens == 64 and again.cached_tokens == 64
        # the loaded blocks are GPU blocks again: a GPU BlockStored for them, no new CPU store
        assert [h for ev in by(e.rec.events(), BlockStored, "GPU") for h in ev.block_hashes][:4] == hashes(e, a)
        assert not by(e.rec.events(), BlockStored, "CPU")
        m.flush()
        assert value(m.prefix_hits) == hits0  # not a GPU hit
        assert value(m.ext_prefix_hits) - ext0 == 64
        assert value(m.cached_by_source["host"]) == 64
        assert value(m.prompt_by_source["external_kv_transfer"]) == 64
        # and it is a GPU hit the next time
        third = await run(e, "a3", prompt(1000))
        assert third.local_hit == 64 and third.external_tokens == 0


async def test_a_gpu_hit_then_an_l1_hit_count_apart():
    async with tiered(num_gpu_blocks=12, cpu_blocks=32, max_model_len=160) as e:
        a = await run(e, "a", prompt(1000, 129))  # 8 full blocks a hit can cover
        await flush_gpu(e, 3)
        # the first two blocks back on the GPU (a prompt sharing them), the rest only in the L1
        await run(e, "head", prompt(1000, 33))
        m = e.m
        m.flush()
        ext0, dev0 = value(m.ext_prefix_hits), value(m.cached_by_source["device"])
        again = await run(e, "a2", prompt(1000, 129))
        assert a.external_tokens == 0
        assert again.local_hit == 32 and again.external_tokens == 96 and again.cached_tokens == 128
        m.flush()
        assert value(m.cached_by_source["device"]) - dev0 == 32
        assert value(m.ext_prefix_hits) - ext0 == 96


async def test_the_l1_evicts_least_recently_used_blocks_with_cpu_removed_events():
    async with tiered(cpu_blocks=6) as e:
        a = await run(e, "a", prompt(1000))
        e.rec.clear()
        await run(e, "b", prompt(2000))
        removed = by(e.rec.events(), BlockRemoved, "CPU")
        # room for 2 more: a's tail goes first (a request's first block is its most recent)
        assert len(removed) == 1 and sorted(removed[0].block_hashes) == sorted(hashes(e, a)[2:])
        assert e.tier_state()["l1"] == {"blocks": 6, "capacity": 6, "pinned": 0}


async def test_loads_that_would_hold_the_gpu_hostage_wait_their_turn():
    # 19 GPU blocks; each request needs 17 and finds its first 8 in the L1. Two loads at once would
    # hold 16 blocks between them and wait for ever for the rest: vLLM admits a load only when its
    # whole sequence fits beside the loads already in flight.
    async with tiered(num_gpu_blocks=20, cpu_blocks=200, max_model_len=300, l1_load_time_per_token=1e-4) as e:
        for i in range(4):
            await run(e, f"warm{i}", prompt(1000 * (i + 1), 129))
        seqs = [Seq(f"r{i}", prompt(1000 * (i + 1), 257), 4, collector=Collector(1)) for i in range(4)]
        for seq in seqs:
            e.submit(seq)
        await asyncio.wait_for(asyncio.gather(*(s.collector.done for s in seqs)), 20)
        assert [s.finish_reason for s in seqs] == ["length"] * 4
        assert [s.external_tokens for s in seqs] == [128] * 4


def test_the_l1_never_evicts_pinned_blocks_and_skips_a_store_without_room():
    l1 = CpuTier(2)
    assert l1.store([b"a", b"b"]) == ([b"a", b"b"], [])
    l1.pin([b"a", b"b"])
    assert l1.store([b"c"]) is None and b"c" not in l1  # all pinned: the store is skipped
    l1.unpin([b"b"])
    assert l1.store([b"c"]) == ([b"c"], [b"b"])


async def test_reset_external_empties_the_l1_without_events():
    async with tiered() as e:
        await run(e, "a", prompt(1000))
        e.rec.clear()
        assert e.reset_prefix_cache(reset_connector=True)
        assert e.tier_state()["l1"]["blocks"] == 0
        assert not by(e.rec.events(), BlockRemoved, "CPU")


def test_tiers_need_prefix_caching_and_an_l2_needs_an_l1():
    with pytest.raises(ValueError, match="prefix caching"):
        SimConfig(cpu_blocks=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cpu_blocks"):
        SimConfig(l2_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="redis://"):
        SimConfig(cpu_blocks=8, l2_url="http://x")


# ------------------------------------------------------------------------------------- L2
async def test_a_prompt_computed_on_one_engine_is_an_l2_hit_on_another():
    l2 = InProcessL2(100)
    costs = {
        "l2_latency": 0.05,
        "l2_bandwidth_gbps": 8.0,
        "kv_bytes_per_token": 1_000_000,
        "l1_load_time_per_token": 1e-4,
    }
    async with tiered(l2, **costs) as a, tiered(l2, **costs) as b:
        first = await run(a, "a", prompt(1000))
        await until(lambda: len(l2.lru) == 4, what="the upload")
        storage = by(a.rec.events(), BlockStored, "STORAGE")
        assert [ev.block_hashes for ev in storage] == [[h] for h in hashes(a, first)]
        assert {ev.locality for ev in storage} == {"REMOTE"}  # a shared store, as vLLM's remote tier says
        again = await run(b, "b", prompt(1000))
        # 64 tokens x 1 MB over 8 Gbit/s = 64 ms, + 50 ms latency, + 6.4 ms host -> GPU
        assert again.first_token_t - again.arrival >= 0.05 + 0.064 + 0.0064
        assert again.external_tokens == 64 and again.cached_tokens == 64
        events = b.rec.events()
        cpu, gpu = by(events, BlockStored, "CPU"), by(events, BlockStored, "GPU")
        assert [ev.block_hashes for ev in cpu][:4] == [[h] for h in hashes(a, first)]  # promoted into B's L1
        assert [h for ev in gpu for h in ev.block_hashes][:4] == hashes(a, first)  # then GPU blocks
        assert events.index(cpu[0]) < events.index(gpu[0])
        assert not by(events, BlockStored, "STORAGE")  # a promotion does not cascade back
        b.m.flush()
        assert value(b.m.cached_by_source["disk"]) == 64 and value(b.m.cached_by_source["host"]) == 0
        assert b.tier_state()["l2_hit_tokens"] == 64


async def test_the_l2_is_bounded_least_recently_used_first():
    l2 = InProcessL2(6)
    async with tiered(l2) as a:
        first = await run(a, "a", prompt(1000))
        await until(lambda: len(l2.lru) == 4)
        await run(a, "b", prompt(2000))
        await until(lambda: len(l2.lru) == 6 and a.tier_state()["l2_stored"] == 8)
        assert await l2.probe(first.digests[:4]) == [True, True, False, False]  # a's tail went first


async def test_an_unreachable_l2_leaves_the_engine_serving_and_says_so_once(caplog):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    l2 = RedisL2(f"redis://127.0.0.1:{port}/0", "t", 100, timeout=0.2)
    with caplog.at_level(logging.WARNING, logger="engine_model.tiers"):
        async with tiered(l2) as e:
            for i in range(3):
                seq = await run(e, f"r{i}", prompt(1000 + i))
                assert seq.finish_reason == "length"
            assert await l2.size() is None
    assert len([r for r in caplog.records if "serving without L2" in r.message]) == 1
    assert l2.describe()["reachable"] is False


async def redis_or_skip() -> RedisL2:
    l2 = RedisL2("redis://127.0.0.1:6379/0", f"pdgate-test:{uuid.uuid4().hex}", 3, timeout=0.5)
    if await l2.size() is None:
        pytest.skip("no Redis on 127.0.0.1:6379")
    return l2


async def test_the_redis_l2_keeps_the_most_recent_blocks_within_its_capacity():
    l2 = await redis_or_skip()
    try:
        assert await l2.put([b"a", b"b"])
        await l2.touch([b"a"])  # a is now more recent than b
        assert await l2.put([b"c", b"d"])  # 4 > 3: the least recent (b) goes
        assert await l2.probe([b"a", b"b", b"c", b"d", b"e"]) == [True, False, True, True, False]
        assert await l2.size() == 3
    finally:
        r = l2._redis()
        await r.delete(l2.zkey, l2.ckey)
        await l2.close()


# ------------------------------------------------------------------------------------- fleet
def test_the_fleet_shares_an_l2_in_virtual_time():
    settings = {"block_size": BS, "num_gpu_blocks": 64, "max_model_len": 512, "cpu_blocks": 32, "l2_blocks": 1000,
                "prefill_time_per_token": 1e-3, "l2_latency": 0.01, "l1_load_time_per_token": 1e-5}  # fmt: skip

    async def go() -> tuple[list[float], dict, dict]:
        fleet = Fleet(settings, Layout(0, 2, "colocated"), shared_l2=True)
        await fleet.start()
        try:
            ttfts = []
            for idx, engine in enumerate(fleet.engines):  # the same prompt on each engine in turn
                seq = Seq(f"j{idx}", list(range(1000, 1257)), 2, collector=Collector(1))
                seq.arrival = asyncio.get_running_loop().time()
                engine.submit(seq)
                await seq.collector.done  # type: ignore[union-attr]
                ttfts.append(seq.first_token_t - seq.arrival)
                await asyncio.sleep(1.0)  # the upload
            return ttfts, fleet.engines[0].tier_state(), fleet.engines[1].tier_state()
        finally:
            await fleet.stop()

    ttfts, first, second = virtual.run(go())
    assert first["l2_stored"] == 16 and second["l2_hit_tokens"] == 256
    # 257 tokens computed (0.257 s) vs 1 token after an L2 load (10 ms + 2.6 ms)
    assert ttfts[0] == pytest.approx(0.257) and ttfts[1] < 0.02


def test_simulate_with_a_shared_l2_serves_repeated_prefixes_faster():
    base = {"block_size": BS, "num_gpu_blocks": 80, "max_model_len": 1200, "prefill_time_per_token": 2e-4,
            "step_base_time": 1e-3, "cpu_blocks": 200, "l2_latency": 0.002, "l1_load_time_per_token": 1e-6}  # fmt: skip
    jobs = [Job(i * 0.5, 1040, 4, 0.1, 1.0, prefix=(1 + i % 3, 1024)) for i in range(24)]
    layout = Layout(0, 2, "colocated")
    plain = simulate({k: v for k, v in base.items() if k != "cpu_blocks"}, layout, jobs)
    tiered_ = simulate(base, layout, jobs, shared_l2=True)
    p50 = tiered_.percentile("ttft_s", 0.5)
    assert p50 is not None and not math.isinf(p50)
    assert p50 < plain.percentile("ttft_s", 0.5)  # type: ignore[operator]
    assert tiered_.attainment() > plain.attainment()


# ------------------------------------------------------------------------------------- flags, profiles
def test_the_tier_flags_reach_the_engine_and_a_profile_supplies_the_costs():
    from sim.cli import build_parser, config_from_args

    argv = ["--profile", "llama-3.3-70b-tp8-h100", "--cpu-blocks", "20000", "--l2-url", "redis://127.0.0.1:6379/3",
            "--l2-key-prefix", "bench", "--l2-blocks", "500000", "--self-describing-kv-events"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv), argv)
    assert (cfg.cpu_blocks, cfg.l2_url, cfg.l2_key_prefix, cfg.l2_blocks) == (
        20000,
        "redis://127.0.0.1:6379/3",
        "bench",
        500_000,
    )
    assert cfg.self_describing_kv_events
    # an 8k-token L1 hit: 6.2 ms, as measured (kv-tiers-2026.md), against 381 ms of prefill it saves
    assert cfg.l1_load_time(8192) == pytest.approx(0.0062, rel=0.02)
    assert cfg.prefill_time(8192) > 50 * cfg.l1_load_time(8192)
    # an 8k-token L2 hit through one Redis (5.85 GB/s) moves 2.7 GB: slower than recomputing it
    assert cfg.l2_load_time(8192) == pytest.approx(0.001 + 8192 * 327680 / 5.85e9, rel=0.01)
    assert cfg.l2_load_time(8192) > cfg.prefill_time(8192)
    off = config_from_args(build_parser().parse_args([]), [])
    assert off.cpu_blocks == 0 and off.l2_url is None  # off by default: the engine as before
