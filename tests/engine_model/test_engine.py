"""The engine core in-process (engine_model.engine): scheduling, KV blocks, preemption, aborts and
the latency model. The P/D side channel is tests/engine_model/test_kv_transfer.py."""

from __future__ import annotations

import asyncio

from tests.engine_model.helpers import make_seq, run, running, text_of


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
