"""The P/D side of the engine in-process (engine_model.kv_transfer): a prefill leg's held blocks, a
decode leg's pull over the side channel between two engines sharing one event loop (real loopback
TCP), failures, expiry and heartbeats."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_model.seq import DECODE, PREFILL
from engine_model.tokens import block_chain
from tests.engine_model.helpers import hist_count, make_seq, run, running, text_of
from tests.waiting import until


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
