"""The engine's cost model (step time, KV transfer time, time scale), the profiles and their CLI,
continuous batching with chunked prefill."""

from __future__ import annotations

import asyncio

import pytest

from engine_model import profile
from engine_model.config import SimConfig, attention_pairs
from engine_model.seq import Collector, Seq
from sim.cli import build_parser, config_from_args
from sim.state import SimState


def test_step_time_terms():
    cfg = SimConfig(
        step_base_time=0.01,
        prefill_time_per_token=1e-4,
        decode_time_per_token=0.002,
        decode_time_per_seq=0.001,
        context_time_per_token=1e-6,
    )
    assert cfg.step_time(0, 0, 0) == 0  # an empty step costs nothing (the loop waits instead)
    assert cfg.step_time(100, 0, 0) == pytest.approx(0.01 + 0.01)
    assert cfg.step_time(0, 4, 1000) == pytest.approx(0.01 + 0.002 + 0.004 + 0.001)
    # A prefill chunk and decodes in one step: every decoding stream waits for the chunk.
    assert cfg.step_time(8192, 4, 1000) == pytest.approx(0.01 + 0.8192 + 0.002 + 0.004 + 0.001)
    # A chunk's attention over what is computed before it: later chunks of a long prompt cost more.
    attn = SimConfig(prefill_attention_time=1e-9, max_num_batched_tokens=1000, max_model_len=4000)
    assert attention_pairs(1000, 0) == 1000 * 500.5 and attention_pairs(1000, 2000) == 1000 * 2500.5
    assert attn.step_time(1000, 0, 0, attention_pairs(1000, 2000)) == pytest.approx(2.5005e-3)
    # A 3000-token prompt alone: three chunks, each attending to more than the one before.
    assert attn.prefill_time(3000) == pytest.approx(1e-9 * 1000 * (500.5 + 1500.5 + 2500.5))
    assert attn.prefill_time(3000, cached_tokens=2000) == pytest.approx(2.5005e-3)  # a cached prefix is not redone
    half = SimConfig(step_base_time=0.01, prefill_time_per_token=1e-4, time_scale=0.5)
    assert half.step_time(100, 0, 0) == pytest.approx(0.01)
    assert not half.instant and SimConfig().instant
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=0)
    with pytest.raises(ValueError, match="decode_time_per_seq"):
        SimConfig(decode_time_per_seq=-1)


def test_kv_transfer_time():
    cfg = SimConfig(kv_bytes_per_token=327680, kv_bandwidth_gbps=1600, kv_transfer_latency=0.002)
    # 8192 tokens x 320 KiB over 1600 Gbit/s = 13.4 ms, plus the fixed cost.
    assert cfg.kv_transfer_time(8192) == pytest.approx(0.002 + 8192 * 327680 * 8 / 1.6e12)
    assert cfg.kv_transfer_time(0) == 0
    assert SimConfig(kv_transfer_time_per_token=1e-5).kv_transfer_time(1000) == pytest.approx(0.01)
    assert SimConfig(kv_transfer_latency=0.01, time_scale=0.1).kv_transfer_time(1) == pytest.approx(0.001)
    # Per block (NIXL descriptors): the same prompt costs 4x less of it in blocks of 64 than of 16.
    b16 = SimConfig(kv_transfer_time_per_block=1e-3, block_size=16)
    b64 = SimConfig(kv_transfer_time_per_block=1e-3, block_size=64)
    assert b16.kv_transfer_time(1000) == pytest.approx(63e-3) and b64.kv_transfer_time(1000) == pytest.approx(16e-3)


@pytest.mark.parametrize("name", profile.available())
def test_bundled_profiles_build_a_config(name: str):
    doc = profile.load(name)
    assert doc["sources"], "every profile says where its numbers come from"
    cfg = SimConfig(**profile.engine_settings(name))
    assert cfg.profile == name and not cfg.instant
    # One full-length request fits (SimConfig checks it) and a decode step costs something.
    assert cfg.step_time(0, 1, 1) > 0


def test_70b_profile_matches_the_model_shape():
    eng = profile.engine_settings("llama-3.3-70b-tp8-h100")
    assert eng["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    cfg = SimConfig(**eng)
    # Batch-1 ITL in the 10-15 ms range reported for 70B at TP8 on H100, prefill ~25k tokens/s.
    assert 0.010 <= cfg.step_time(0, 1, 1000) <= 0.015
    assert 20_000 <= 1 / cfg.prefill_time_per_token <= 30_000


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown profile"):
        profile.load("no-such-profile")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {prefill_time_per_tokn: 1}\n")
    with pytest.raises(ValueError, match="unknown engine settings"):
        profile.load(str(bad))
    bad.write_text("name: x\n")
    with pytest.raises(ValueError, match="engine"):
        profile.load(str(bad))


def test_cli_profile_then_explicit_flags():
    argv = ["--profile", "llama-3.3-70b-tp8-h100", "--time-scale", "0.25", "--max-num-seqs", "7"]
    cfg = config_from_args(build_parser().parse_args(argv), argv)
    assert cfg.profile == "llama-3.3-70b-tp8-h100" and cfg.time_scale == 0.25
    assert cfg.step_base_time == 0.0105 and cfg.num_gpu_blocks == 76900
    assert cfg.max_num_seqs == 7  # the flag wins over the profile's 1024
    # Parsed elsewhere (no argv): a value other than the flag's default counts as given.
    cfg = config_from_args(build_parser().parse_args(["--profile", "fast", "--block-size", "32"]))
    assert (
        cfg.block_size == 32 and cfg.prefill_time_per_token == profile.engine_settings("fast")["prefill_time_per_token"]
    )
    # Without a profile nothing changes: every latency is 0 (instant mode).
    assert config_from_args(build_parser().parse_args([]), []).instant


async def test_long_prefill_chunk_stalls_running_streams():
    """Colocated interference: a stream decoding in 10 ms steps waits for each ~4096-token prefill
    chunk scheduled with it (~0.4 s); the chunked prefill of 8192 tokens with a 4096-token
    budget takes three steps. Only lower bounds on wall time (sleeps never end early)."""
    state = SimState(
        SimConfig(
            step_base_time=0.01,
            prefill_time_per_token=1e-4,
            max_num_batched_tokens=4096,
            max_model_len=16384,
            num_gpu_blocks=2048,
        )
    )
    await state.start()
    try:
        engine = state.engine
        stream = Seq("s", [5] * 16, 60, collector=Collector(1))
        engine.submit(stream)
        for _ in range(3):  # the collector's event is set at every token
            stream.collector.event.clear()
            await asyncio.wait_for(stream.collector.event.wait(), 5)
        long = Seq("l", [7] * 8192, 1, collector=Collector(1))
        t0 = asyncio.get_running_loop().time()
        n0 = len(stream.output_ids)
        engine.submit(long)
        await asyncio.wait_for(long.collector.done, 10)
        assert asyncio.get_running_loop().time() - t0 >= 2 * (0.01 + 4096 * 1e-4) * 0.95
        # Alone, the stream would have made ~80 tokens in that time; it made one per step: the
        # step in flight when the prompt arrived, then 4095 + 4095 + 2 prompt tokens (its own
        # decode token takes one of each step's 4096).
        assert len(stream.output_ids) - n0 <= 4
        await asyncio.wait_for(stream.collector.done, 10)
    finally:
        await state.stop()


async def test_engine_charges_each_chunk_its_attention():
    """A 3000-token prompt in 1000-token chunks: the engine's steps take at least the model's
    1000 * (500.5 + 1500.5 + 2500.5) pairs of attention (0.45 s); a flat per-token cost would be 0."""
    cfg = SimConfig(prefill_attention_time=1e-7, max_num_batched_tokens=1000, max_model_len=4096, num_gpu_blocks=512)
    state = SimState(cfg)
    await state.start()
    try:
        seq = Seq("p", [3] * 3000, 1, collector=Collector(1))
        t0 = asyncio.get_running_loop().time()
        state.engine.submit(seq)
        await asyncio.wait_for(seq.collector.done, 10)
        assert asyncio.get_running_loop().time() - t0 >= cfg.prefill_time(3000) * 0.95
    finally:
        await state.stop()
