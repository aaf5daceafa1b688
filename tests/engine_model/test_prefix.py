"""The simulator's prefix cache in-process: hits, LRU eviction, reset, P/D with caching, and
that its block hashes are the gateway's (``policies.beliefs.blockhash``)."""

from __future__ import annotations

import contextlib

import pytest

from engine_model.config import SimConfig
from engine_model.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig
from engine_model.metrics import cache_config_labels
from engine_model.seq import DECODE, PREFILL, Collector, Seq
from policies.beliefs.blockhash import HashSpec, block_hashes
from sim.state import SimState
from tests.engine_model.helpers import hist_count, make_seq, run, text_of
from tests.waiting import until


class Recorder:
    """Stands in for the ZMQ publisher: keeps every batch the engine publishes."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events: list) -> None:
        self.batches.append(list(events))

    def events(self) -> list:
        return [e for b in self.batches for e in b]

    def clear(self) -> None:
        self.batches.clear()


@contextlib.asynccontextmanager
async def engine(**kw):
    """A started engine whose KV events go to a Recorder (``st.recorder``)."""
    rec = Recorder()
    state = SimState(SimConfig(**kw), event_sink=rec)
    await state.start()
    state.recorder = rec  # type: ignore[attr-defined]
    try:
        yield state
    finally:
        await state.stop()


def value(lazy) -> float:
    return lazy.child._value.get()


def hist_sum(lazy) -> float:
    return lazy.child._sum.get()


def stored(events: list) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed_hashes(events: list) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


async def test_a_repeated_prompt_hits_the_cache_and_skips_its_prefill():
    async with engine(block_size=4, num_gpu_blocks=65, max_model_len=128) as st:
        prompt = list(range(1000, 1030))  # 30 tokens: 7 full blocks
        first = await run(st, make_seq("a", prompt, 4))
        m = st.metrics
        m.flush()
        assert value(m.prefix_queries) == 30 and value(m.prefix_hits) == 0
        assert first.local_hit == 0
        again = await run(st, make_seq("b", prompt, 4))
        m.flush()
        assert again.local_hit == 28  # 7 blocks; the last prompt token is always computed
        assert text_of(again) == text_of(first)
        assert value(m.prefix_queries) == 60 and value(m.prefix_hits) == 28
        assert value(m.cached_by_source["device"]) == 28
        assert value(m.prompt_by_source["local_cache_hit"]) == 28
        assert value(m.prompt_by_source["local_compute"]) == 30 + 2
        assert value(m.prompt_cached) == 28
        # Prefill work actually skipped: the new-KV histogram saw 30 then 2 tokens.
        assert hist_sum(m.prefill_kv_computed) == 32
        # A prompt sharing only its first 3 blocks reuses exactly those.
        other = await run(st, make_seq("c", prompt[:12] + list(range(5000, 5018)), 4))
        assert other.local_hit == 12
        assert st.engine.kv_usage() == 0  # cached blocks are free (evictable) once released


async def test_block_stored_events_carry_the_gateways_hashes():
    async with engine(block_size=4, num_gpu_blocks=65, max_model_len=128) as st:
        prompt = list(range(7, 25))  # 18 tokens: 4 full prompt blocks
        await run(st, make_seq("a", prompt, 1))
        [ev] = stored(st.recorder.events())
        expected = block_hashes(prompt, HashSpec(block_size=4))
        assert ev.block_hashes == expected and ev.parent_block_hash is None
        assert ev.token_ids == prompt[:16] and ev.block_size == 4
        assert (ev.lora_id, ev.medium, ev.lora_name, ev.group_idx) == (None, "GPU", None, 0)
        assert ev.extra_keys == [None] * 4
        # A longer prompt with the same head caches only its new blocks, chained to the old ones.
        st.recorder.clear()
        longer = prompt + list(range(100, 110))  # 28 tokens: 7 blocks, 4 of them cached
        seq = await run(st, make_seq("b", longer, 1))
        assert seq.local_hit == 16
        [ev2] = stored(st.recorder.events())
        full = block_hashes(longer, HashSpec(block_size=4))
        assert ev2.block_hashes == full[4:7] and ev2.parent_block_hash == full[3]
        assert ev2.token_ids == longer[16:28]


async def test_lru_eviction_emits_block_removed_oldest_first():
    # 12 usable blocks of 4 tokens; each prompt of 16 tokens + 1 output needs 5 blocks.
    async with engine(block_size=4, num_gpu_blocks=13, max_model_len=32) as st:
        a, b = list(range(16)), list(range(100, 116))
        c = list(range(200, 220))  # 5 blocks: the 4 never-used blocks, then one eviction
        ha, hb = block_hashes(a, HashSpec(block_size=4)), block_hashes(b, HashSpec(block_size=4))
        await run(st, make_seq("a", a, 1))
        await run(st, make_seq("b", b, 1))
        assert st.engine.pool.num_cached == 8 and st.engine.pool.num_free == 12
        st.recorder.clear()
        await run(st, make_seq("c", c, 1))
        assert removed_hashes(st.recorder.events()) == [ha[3]]  # a was freed first; its tail goes first
        st.recorder.clear()
        # a's other blocks still hit (at most 3 blocks: the last prompt token is computed); its
        # one new block evicts the next least recently freed block, b's tail.
        hit_a = await run(st, make_seq("a2", a, 1))
        assert hit_a.local_hit == 12
        assert removed_hashes(st.recorder.events()) == [hb[3]]
        hit_b = await run(st, make_seq("b2", b, 1))
        assert hit_b.local_hit == 12


async def test_reset_is_refused_while_blocks_are_in_use_then_clears_everything():
    async with engine(role="prefill", block_size=4, num_gpu_blocks=33, max_model_len=64) as st:
        prompt = list(range(20))
        pre = await run(st, make_seq("p", prompt, 1, kind=PREFILL))
        assert st.engine.reset_prefix_cache() is False  # the held blocks are in use
        st.engine._release_held(pre.req_id)
        st.recorder.clear()
        assert st.engine.reset_prefix_cache() is True
        assert [type(e) for e in st.recorder.events()] == [AllBlocksCleared]
        assert st.engine.pool.num_cached == 0
        again = await run(st, make_seq("q", prompt, 1))
        assert again.local_hit == 0


async def test_prefix_caching_off():
    async with engine(block_size=4, num_gpu_blocks=33, max_model_len=64, enable_prefix_caching=False) as st:
        prompt = list(range(20))
        await run(st, make_seq("a", prompt, 2))
        again = await run(st, make_seq("b", prompt, 2))
        assert again.local_hit == 0 and st.recorder.events() == []
        st.metrics.flush()
        assert value(st.metrics.prefix_queries) == 0  # vLLM records no stats without a lookup
    labels = cache_config_labels(SimConfig(enable_prefix_caching=False, prefix_caching_hash_algo="sha256_cbor"))
    assert labels["enable_prefix_caching"] == "False" and labels["prefix_caching_hash_algo"] == "sha256_cbor"
    assert cache_config_labels(SimConfig())["enable_prefix_caching"] == "True"


async def test_pd_with_caching_pulls_only_missing_blocks_and_caches_them():
    async with (
        engine(role="prefill", block_size=4, engine_id="P") as p,
        engine(role="decode", block_size=4, engine_id="D", enable_prompt_tokens_details=True) as d,
    ):
        prompt = list(range(300, 340))  # 40 tokens, 10 blocks
        plain = await run(d, make_seq("plain", prompt[:18], 1))  # D now caches blocks 0-3 (16 tokens)
        assert plain.local_hit == 0
        pre1 = await run(p, make_seq("pre1", prompt, 1, kind=PREFILL))
        assert pre1.kv_out["remote_prefill_cached_tokens"] == 0
        pre2 = await run(p, make_seq("pre2", prompt, 1, kind=PREFILL))
        assert pre2.kv_out["remote_prefill_cached_tokens"] == 36  # P's own hit
        # pre2's handle names the hit blocks, shared with pre1's (both held).
        assert pre2.kv_out["remote_block_ids"][0][:9] == pre1.kv_out["remote_block_ids"][0][:9]
        p.engine._release_held(pre1.req_id)

        d.recorder.clear()
        dec = await run(d, make_seq("dec", prompt, 3, kind=DECODE, kv_in=pre2.kv_out))
        assert dec.finish_reason == "length"
        assert dec.local_hit == 16 and dec.external_tokens == 24
        assert dec.cached_tokens == 36  # usage reports the prefill engine's hits, as vLLM 0.32
        d.metrics.flush()
        assert value(d.metrics.ext_prefix_queries) - 18 == 24 and value(d.metrics.ext_prefix_hits) == 24
        assert value(d.metrics.prefix_hits) == 16
        # 6 blocks read (blocks 4..9), not 10.
        assert hist_sum(d.metrics.nixl_bytes) == 6 * 4 * d.cfg.kv_bytes_per_token
        # The pulled blocks enter D's prefix cache, chained to the local hit.
        ev = stored(d.recorder.events())[0]
        full = block_hashes(prompt, HashSpec(block_size=4))
        assert ev.block_hashes == full[4:10] and ev.parent_block_hash == full[3]
        await until(lambda: pre2.req_id not in p.engine.held, timeout=3)
        # The same text as a local run of the whole prompt: the right KV arrived.
        local = await run(d, make_seq("local", prompt, 3))
        assert text_of(local) == text_of(dec) and local.local_hit == 36


async def test_preempted_request_reuses_its_cached_blocks_without_counting_twice():
    # Two long-running requests in a pool too small for both to grow: one is preempted.
    async with engine(block_size=4, num_gpu_blocks=11, max_model_len=36, decode_time_per_token=0.001) as st:
        s1 = make_seq("s1", list(range(16)), 12)
        s2 = Seq("s2", list(range(100, 116)), 12, collector=Collector(1))
        st.engine.submit(s1)
        st.engine.submit(s2)
        await s1.collector.done
        await s2.collector.done
        assert s1.num_preemptions + s2.num_preemptions >= 1
        st.metrics.flush()
        assert value(st.metrics.prefix_queries) == 32  # first admissions only
        assert value(st.metrics.preemptions) >= 1
        assert hist_count(st.metrics.req_preemptions) == 2


def test_kv_events_config_parsing():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert cfg.publisher == "zmq" and cfg.active and cfg.buffer_steps == 10_000 and cfg.hwm == 100_000
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": false}').publisher == "null"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').active
    with pytest.raises(ValueError, match="unknown"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoints": "x"}')
    with pytest.raises(ValueError):
        KVEventsConfig.from_json('{"publisher": "kafka"}')
