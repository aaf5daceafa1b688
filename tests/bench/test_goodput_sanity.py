"""The engine model shows what disaggregation is for, through the real gateway.

With the Llama-3.3-70B profile (run at half speed), a long-context mix on colocated engines makes
every stream wait for the long prefill chunks scheduled with it, and P/D removes those stalls from
the decode engine's streams; on short chat P/D only adds a hop and a KV transfer. Assertions are
on simulated latencies with wide margins (the effects are several-fold), never on wall time.
"""

from __future__ import annotations

import pytest

from bench import goodput

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def result() -> dict:
    args = goodput.parse_args(
        ["--quick", "--configs", "colocated-prefix-load", "pd-always", "--workloads", "long", "chat",
         "--rate-for", "long=2", "chat=3", "--duration", "10"]
    )  # fmt: skip
    return goodput.run(args)


def _point(result: dict, config: str, workload: str) -> dict:
    return next(p for p in result["points"] if p["config"] == config and p["workload"] == workload)


def test_pd_lowers_tail_itl_on_long_context(result: dict) -> None:
    colo = _point(result, "colocated-prefix-load", "long")
    pd = _point(result, "pd-always", "long")
    assert colo["failed"] == 0 and pd["failed"] == 0
    assert pd["paths"] == {"pd": pd["completed"]}
    # Colocated: 8k-token prefill chunks (~0.33 s each) land between two tokens of running streams.
    assert colo["itl_ms"]["p99"] > 100, colo
    assert pd["itl_ms"]["p99"] * 2 < colo["itl_ms"]["p99"], (pd, colo)


def test_pd_does_not_help_short_chat(result: dict) -> None:
    colo = _point(result, "colocated-prefix-load", "chat")
    pd = _point(result, "pd-always", "chat")
    assert colo["failed"] == 0 and pd["failed"] == 0
    # The prefill hop, the KV pull and one prefill engine instead of two: slower first tokens,
    # and no more requests within the SLO.
    assert pd["ttft_ms"]["p50"] > colo["ttft_ms"]["p50"], (pd, colo)
    assert pd["goodput_req_s"] <= colo["goodput_req_s"], (pd, colo)
    # Short prompts barely stall anyone, so there is little tail to remove.
    assert colo["itl_ms"]["p99"] < 100, colo
