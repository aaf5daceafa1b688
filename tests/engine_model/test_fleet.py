"""The in-process fleet on a virtual clock: the same engine as ``pdgate sim``, simulated time
jumping from step to step; what it shows must be the engine model's physics."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_model import profile, virtual
from engine_model.config import SimConfig, attention_pairs
from engine_model.fleet import Job, Layout, simulate

H100 = profile.engine_settings("llama-3.3-70b-tp8-h100")


def test_virtual_clock_jumps_and_refuses_to_hang():
    async def main() -> tuple[float, list[float]]:
        loop = asyncio.get_running_loop()

        async def at(d: float) -> float:
            await asyncio.sleep(d)
            return loop.time()

        return loop.time(), list(await asyncio.gather(at(3600), at(1), at(60)))

    t0 = time.monotonic()
    start, ends = virtual.run(main())
    assert start == 0 and ends == [3600, 1, 60]
    assert time.monotonic() - t0 < 1  # an hour of simulated time, at once

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(RuntimeError, match="stuck"):
        virtual.run(stuck())


def _stream_and_long() -> list[Job]:
    return [
        Job(0.0, 200, 100, 1.0, 0.05, klass="chat"),  # a stream decoding for ~1 s
        Job(0.5, 16000, 10, 3.0, 0.05, klass="long"),  # a long prompt arriving while it runs
    ]


def test_a_long_prompt_stalls_a_colocated_stream_but_not_a_pd_one():
    colo = simulate(H100, Layout(0, 1, "colocated"), _stream_and_long())
    pd = simulate(H100, Layout(1, 1, "threshold", 4096), _stream_and_long())
    stream_colo, stream_pd = colo.outcomes[0], pd.outcomes[0]
    # Colocated: the stream waits for each of the two 8k chunks (~0.38 and ~0.43 s).
    assert stream_colo.itl_p99_s > 0.3
    assert stream_pd.itl_p99_s < 0.02 and stream_pd.path == "direct"
    assert pd.outcomes[1].path == "pd" and colo.outcomes[1].path == "direct"
    assert colo.attainment(tail=True) == 0.5 and pd.attainment(tail=True) == 1.0


def test_pd_ttft_is_prefill_plus_handover():
    """An idle fleet: TTFT = the prefill (two chunks) + the hand-over (fixed + blocks + bytes)
    + the recomputed last token, as the profile's cost model says."""
    n = 12000
    res = simulate(H100, Layout(1, 1, "always"), [Job(0.0, n, 5, 10.0, 1.0)])
    cfg = SimConfig(**H100)
    expected = cfg.prefill_time(n) + cfg.kv_transfer_time(n) + cfg.step_time(1, 0, 0, attention_pairs(1, n - 1))
    assert res.outcomes[0].ttft_s == pytest.approx(expected, rel=0.02)


def test_runs_are_deterministic_and_unserved_jobs_fail_at_the_horizon():
    jobs = [Job(i * 0.05, 8000, 200, 3.0, 0.05) for i in range(60)]  # 20 req/s of 8k prompts: far too many
    a = simulate(H100, Layout(0, 1, "colocated"), jobs, horizon_s=10.0)
    b = simulate(H100, Layout(0, 1, "colocated"), jobs, horizon_s=10.0)
    assert [o.ttft_s for o in a.outcomes] == [o.ttft_s for o in b.outcomes]
    assert any(o.ttft_s is None for o in a.outcomes)  # still queued at 10 s: failed, not waited for
    assert a.attainment() < 0.5


def test_layouts_are_checked():
    with pytest.raises(ValueError):
        Layout(1, 1, "colocated")
    with pytest.raises(ValueError):
        Layout(0, 2, "threshold")
    with pytest.raises(ValueError):
        Layout(1, 0, "always")
    assert Layout(2, 3, "threshold", 4096).name == "2P+3D (>= 4096 tokens)"
