"""The engine core in-process: scheduling, KV blocks, latency model, and the P/D side channel
between two engines sharing one event loop (over real loopback TCP)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine_model.config import SimConfig
from engine_model.engine import DECODE, PREFILL, Collector, Seq
from engine_model.tokens import block_chain
from sim.app import SimState
from tests.waiting import until


@contextlib.asynccontextmanager
async def running(**kw):
    state = SimState(SimConfig(**kw))
    await state.start()
    try:
        yield state
    finally:
        await state.stop()


def make_seq(rid: str, prompt: list[int], max_tokens: int, **kw) -> Seq:
    return Seq(rid, prompt, max_tokens, collector=Collector(1), **kw)


async def run(state: SimState, seq: Seq, timeout: float = 5.0) -> Seq:
    state.engine.submit(seq)
    await asyncio.wait_for(seq.collector.done, timeout)
    return seq


def hist_count(lazy_hist) -> float:
    return sum(b.get() for b in lazy_hist.child._buckets)


def text_of(seq: Seq) -> str:
    return "".join(seq.pieces)


async def test_plain_request_generates_and_frees_its_blocks():
    async with running(block_size=4, num_gpu_blocks=33, max_model_len=64) as st:
        seq = await run(st, make_seq("a", list(range(10)), 5))
        assert seq.finish_reason == "length" and len(seq.output_ids) == 5
        assert seq.kv_out is None and st.engine.kv_usage() == 0
        again = await run(st, make_seq("b", list(range(10)), 5))
        assert text_of(again) == text_of(seq)  # a function of the prompt only
        other = await run(st, make_seq("c", list(range(1, 11)), 5))
        assert text_of(other) != text_of(seq)
        m = st.metrics
        m.flush()
        assert m.generation_tokens.child._value.get() == 15
        # "b" found a's first two full blocks in the prefix cache (at most 9 of its 10 tokens).
        assert m.prompt_by_source["local_compute"].child._value.get() == 30 - 8
        assert m.prompt_by_source["local_cache_hit"].child._value.get() == 8


async def test_prefill_leg_holds_its_blocks_and_answers_like_nixl():
    async with running(block_size=4, num_gpu_blocks=33, max_model_len=64, engine_id="P-1", kv_host="node-p") as st:
        seq = await run(st, make_seq("cmpl-x-0-abcd1234", list(range(10)), 1, kind=PREFILL))
        kv = seq.kv_out
        assert list(kv) == [
            "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
            "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
            "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens",
        ]  # fmt: skip
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == 3  # ceil(10 / 4)
        assert kv["remote_engine_id"] == "P-1" and kv["remote_request_id"] == "cmpl-x-0-abcd1234"
        assert (kv["remote_host"], kv["remote_port"]) == ("node-p", st.kv_server.port)
        assert (kv["tp_size"], kv["remote_num_tokens"], kv["transfer_mode"]) == (1, 10, "pull")
        assert st.engine.kv_usage() == pytest.approx(3 / 32)
        # the side channel's verdicts
        e = st.engine
        assert e.kv_read({"engine_id": "other", "request_id": "cmpl-x-0-abcd1234"})["status"] == "engine_mismatch"
        assert e.kv_read({"engine_id": "P-1", "request_id": "r", "block_ids": [[999]]})["status"] == "bad_blocks"
        assert e.kv_read({"engine_id": "P-1", "request_id": "nope", "block_ids": [[1]]})["status"] == "unknown"
        ok = e.kv_read({"engine_id": "P-1", "request_id": "cmpl-x-0-abcd1234", "block_ids": kv["remote_block_ids"]})
        assert ok["status"] == "ok" and ok["tags"] == block_chain(list(range(10)), 4)
        unknown = e.kv_read({"engine_id": "P-1", "request_id": "?", "block_ids": kv["remote_block_ids"]})
        assert unknown["status"] == "unknown" and unknown["tags"] == ok["tags"]  # read by block id anyway
        assert e.kv_notify({"engine_id": "P-1", "request_id": "cmpl-x-0-abcd1234"})["status"] == "ok"
        assert e.kv_usage() == 0
        assert e.kv_notify({"engine_id": "P-1", "request_id": "cmpl-x-0-abcd1234"})["status"] == "unknown"
        st.metrics.flush()
        assert st.metrics.nixl_notifs_after_expiry.child._value.get() == 1


async def test_decode_leg_pulls_over_the_side_channel_and_releases_the_remote_blocks():
    async with (
        running(role="prefill", block_size=4, engine_id="P") as p,
        # No prefix cache on D: every decode leg pulls the whole prompt (hits: see test_prefix.py).
        running(
            role="decode", block_size=4, engine_id="D", kv_transfer_time_per_token=0.001, enable_prefix_caching=False
        ) as d,
    ):
        prompt = list(range(40))
        plain = await run(d, make_seq("plain", prompt, 6))
        pre = await run(p, make_seq("pre", prompt, 1, kind=PREFILL))
        assert p.engine.kv_usage() > 0
        t0 = time.monotonic()
        dec = await run(d, make_seq("dec", prompt, 6, kind=DECODE, kv_in=pre.kv_out))
        assert time.monotonic() - t0 >= 0.04  # 40 tokens * 1 ms of transfer
        assert dec.finish_reason == "length" and text_of(dec) == text_of(plain)  # the right KV arrived
        assert dec.external_tokens == 40 and dec.kv_out is None
        await until(lambda: p.engine.kv_usage() == 0)
        d.metrics.flush()
        assert d.metrics.prompt_by_source["external_kv_transfer"].child._value.get() == 40
        assert hist_count(d.metrics.nixl_xfer_time) == 1
        # The handle is gone, but its blocks still hold this prompt's KV (nothing reused them):
        # like NIXL, a second pull reads them and gets the right answer; P counts a late notif.
        again = await run(d, make_seq("dec2", prompt, 6, kind=DECODE, kv_in=pre.kv_out))
        assert again.finish_reason == "length" and text_of(again) == text_of(plain)
        await until(lambda: p.metrics.nixl_notifs_after_expiry.pending == 1)
        # Blocks that hold another prompt's KV give another text (and no error).
        other = await run(p, make_seq("other", list(range(100, 140)), 1, kind=PREFILL))
        wrong = {**other.kv_out, "remote_request_id": "pre"}
        foreign = await run(d, make_seq("dec3", prompt, 6, kind=DECODE, kv_in=wrong))
        assert foreign.finish_reason == "length" and text_of(foreign) != text_of(plain)


@pytest.mark.parametrize("what", ["engine", "port", "blocks"])
async def test_decode_leg_fails_on_a_bad_peer(what):
    from tests.procs import free_port

    async with (
        running(role="prefill", engine_id="P") as p,
        running(role="decode", engine_id="D", kv_handshake_timeout=0.3) as d,
    ):
        pre = await run(p, make_seq("pre", list(range(20)), 1, kind=PREFILL))
        kv = dict(pre.kv_out)
        if what == "engine":
            kv["remote_engine_id"] = "someone-else"
        elif what == "port":
            kv["remote_port"] = free_port()
        else:
            kv["remote_block_ids"] = [[10**9]]
        dec = await run(d, make_seq("dec", list(range(20)), 4, kind=DECODE, kv_in=kv))
        assert dec.finish_reason == "error" and dec.output_ids == [] and dec.error
        assert d.engine.kv_usage() == 0
        d.metrics.flush()
        assert d.metrics.nixl_failed_transfers.child._value.get() == 1
        assert d.metrics.success["error"].child._value.get() == 1
        if what == "blocks":  # the handle is released (as observed with vLLM 0.32)
            await until(lambda: p.engine.kv_usage() == 0)
        else:  # like vLLM: no handshake, no notification: the blocks wait for their expiry
            assert p.engine.kv_usage() > 0


async def test_blocks_expire_and_heartbeats_extend_the_lease():
    async with running(role="prefill", kv_expiry=0.6, engine_id="P") as p:
        a = await run(p, make_seq("a", list(range(20)), 1, kind=PREFILL))
        b = await run(p, make_seq("b", list(range(20)), 1, kind=PREFILL))
        await asyncio.sleep(0.4)
        assert p.engine.kv_heartbeat({"engine_id": "P", "request_ids": ["b"]})["status"] == "ok"
        held = p.engine.held
        assert held["b"].timer.when() > held["a"].timer.when() + 0.2  # renewed for 2/3 of the expiry
        await until(lambda: "a" not in held)
        assert set(held) == {"b"}
        await until(lambda: not p.engine.held, timeout=2)
        assert p.engine.kv_usage() == 0
        p.metrics.flush()
        assert p.metrics.nixl_kv_expired.child._value.get() == 2
        assert a.kv_out and b.kv_out


async def test_max_num_seqs_makes_requests_wait():
    async with running(max_num_seqs=1, decode_time_per_token=0.01) as st:
        s1, s2 = make_seq("1", [1, 2, 3], 5), make_seq("2", [4, 5, 6], 5)
        st.engine.submit(s1)
        st.engine.submit(s2)
        await asyncio.sleep(0.02)
        st.engine.update_gauges()
        st.metrics.flush()
        assert (st.metrics.running._value.get(), st.metrics.waiting._value.get()) == (1, 1)
        await asyncio.wait_for(asyncio.gather(s1.collector.done, s2.collector.done), 5)
        assert s2.scheduled_t >= s1.finished_t - 0.001


async def test_preemption_when_kv_runs_out_keeps_outputs_identical():
    async with running(block_size=4, num_gpu_blocks=6, max_model_len=20) as st:
        alone = await run(st, make_seq("alone", [1, 2, 3, 4], 12))
        s1, s2 = make_seq("1", [1, 2, 3, 4], 12), make_seq("2", [1, 2, 3, 4], 12)
        st.engine.submit(s1)
        st.engine.submit(s2)
        await asyncio.wait_for(asyncio.gather(s1.collector.done, s2.collector.done), 5)
        assert text_of(s1) == text_of(s2) == text_of(alone)
        assert s1.num_preemptions + s2.num_preemptions >= 1
        assert st.engine.kv_usage() == 0


async def test_abort_during_prefill_frees_blocks_and_is_not_counted_as_success():
    async with running(prefill_time_per_token=0.002, block_size=4) as st:
        seq = make_seq("a", list(range(500)), 5)
        st.engine.submit(seq)
        await asyncio.sleep(0.1)
        assert st.engine.kv_usage() > 0 and seq.output_ids == []
        st.engine.abort(seq)
        assert seq.finish_reason == "abort" and seq.collector.done.done()
        assert st.engine.kv_usage() == 0 and not st.engine.running
        st.metrics.flush()
        assert sum(c.child._value.get() for c in st.metrics.success.values()) == 0


async def test_aborting_a_queued_decode_leg_releases_the_prefill_blocks():
    async with (
        running(role="prefill", engine_id="P") as p,
        running(role="both", engine_id="D", max_num_seqs=1, decode_time_per_token=0.05) as d,
    ):
        busy = make_seq("busy", [1, 2, 3], 50)
        d.engine.submit(busy)
        pre = await run(p, make_seq("pre", list(range(30)), 1, kind=PREFILL))
        dec = make_seq("dec", list(range(30)), 4, kind=DECODE, kv_in=pre.kv_out)
        d.engine.submit(dec)
        await asyncio.sleep(0.05)
        assert dec.state == "waiting" and p.engine.kv_usage() > 0
        d.engine.abort(dec)
        await until(lambda: p.engine.kv_usage() == 0)
        d.engine.abort(busy)


async def test_a_long_prefill_stalls_decoding_streams():
    async with running(prefill_time_per_token=0.001, decode_time_per_token=0.005) as st:
        streaming = make_seq("s", [1, 2, 3], 40)
        st.engine.submit(streaming)
        await asyncio.sleep(0.05)
        long = make_seq("long", list(range(300)), 1)
        st.engine.submit(long)
        await asyncio.wait_for(asyncio.gather(streaming.collector.done, long.collector.done), 5)
        # one inter-token gap of the stream contains the 300-token prefill (~0.3 s)
        assert streaming.finished_t - streaming.first_token_t >= 0.3 + 39 * 0.005 * 0.9
