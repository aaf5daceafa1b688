"""Tier beliefs (L1 per engine, shared L2), what answers teach them, and the decisions they change."""

from __future__ import annotations

import pytest

from policies.base import LegOutcome, LegReport, Path
from policies.beliefs.tiers import TIERS, TierBeliefs, TierHold, TierIndex, hold_of, to_compute
from policies.cost_model import CostModel
from policies.token_threshold import TokenThreshold

from .helpers import ctx, ep

A, B = "http://a:8000", "http://b:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_loads_block_by_block_from_l1_or_else_l2_until_a_block_no_tier_holds() -> None:
    tiers = TierIndex(l1_capacity=lambda url: 100, l2_capacity=100)
    tiers.stored(A, [3, 4], remote=False)  # A's CPU tier
    tiers.stored(A, [5, 7], remote=True)  # the shared store (REMOTE to the publisher)
    assert tiers.walk(A, [1, 2, 3, 4, 5, 6, 7], start=2) == (2, 1)  # 3, 4 from L1; 5 from L2; 6 nowhere
    assert tiers.walk(B, [1, 2, 3, 4, 5, 6, 7], start=4) == (0, 1)  # B has no L1, but reaches L2
    tiers.removed(A, [4], remote=False)
    assert tiers.walk(A, [1, 2, 3, 4, 5], start=2) == (1, 0)


def test_tiers_hold_no_more_than_their_size_least_recently_used_out_first() -> None:
    tiers = TierIndex(l1_capacity={A: 3}.get, l2_capacity=2)
    tiers.learn(A, [1, 2, 3])
    tiers.learn(A, [1, 9])  # 1 used again; 2 is now the oldest and goes
    assert tiers.walk(A, [1, 2, 3], 0) == (1, 0)
    assert tiers.walk(A, [9], 0) == (1, 0) and tiers.walk(A, [3], 0) == (1, 0)
    tiers.stored(B, [10, 11, 12], remote=True)
    assert tiers.stats().l2 == 2 and tiers.walk(B, [10], 0) == (0, 0)


def test_learning_needs_a_tier_of_known_size_and_l2_only_when_written_through() -> None:
    unknown = TierIndex()  # no L1 size, no L2
    unknown.learn(A, [1, 2])
    unknown.demote(A, [1, 2])
    assert unknown.empty()
    through = TierIndex(l1_capacity=lambda url: None, l2_capacity=10, l2_learn=True)
    through.learn(A, [1, 2])
    assert through.walk(B, [1, 2], 0) == (0, 2)  # computed on A, written through: B can load it


def test_blocks_the_gpu_beliefs_drop_for_room_go_down_to_l1() -> None:
    tiers = TierIndex(l1_capacity=lambda url: 10)
    tiers.demote(A, [1, 2, 3])
    assert tiers.walk(A, [1, 2, 3], 0) == (3, 0) and tiers.stats().demoted == 3


def test_learned_entries_age_out_reported_ones_stay() -> None:
    clock = Clock()
    tiers = TierIndex(l1_capacity=lambda url: 10, ttl_s=60, clock=clock)
    tiers.learn(A, [1, 2])
    tiers.stored(A, [3], remote=False)
    clock.now += 61
    assert tiers.walk(A, [1, 2], 0) == (0, 0)
    assert tiers.walk(A, [3], 0) == (1, 0)


def test_a_restart_drops_the_engines_l1_and_leaves_the_shared_store() -> None:
    tiers = TierIndex(l1_capacity=lambda url: 10, l2_capacity=10)
    tiers.stored(A, [1], remote=False)
    tiers.stored(A, [2], remote=True)
    tiers.forget(A)
    assert tiers.walk(A, [1], 0) == (0, 0) and tiers.walk(A, [2], 0) == (0, 1)


def _tiered(tokens: int, holds: dict[str, TierHold], **kw):
    c = ctx(tokens, block_size=16, **kw)
    c.data.put(TIERS, holds)
    return c


def test_without_tiers_the_breakdown_is_the_gpu_hit_alone() -> None:
    c = ctx(1000, cached_tokens={"d": 512}, block_size=16)
    assert hold_of(c, "d") == TierHold(gpu=512) and to_compute(c, "d") == c.uncached("d") == 488


def test_a_long_prompt_held_in_the_decode_engines_l1_stays_direct_and_says_why() -> None:
    c = _tiered(10_000, {"d": TierHold(gpu=0, l1=9984)})
    choice = TokenThreshold(threshold=4096).decide(c, ep("d"), lambda: ep("p", "prefill"))
    assert choice.path is Path.DIRECT and choice.reason == "prefix_in_tier"
    assert "l1=9984" in choice.detail
    cold = TokenThreshold(threshold=4096).decide(ctx(10_000), ep("d"), lambda: ep("p", "prefill"))
    assert cold.path is Path.PD  # the same prompt, nothing held: P/D


MODEL = CostModel(kv_bytes_per_token=327_680, kv_bandwidth_gbps=400, prefill_tokens_per_s=10_000, pd_overhead_s=0.005)


def test_the_cost_model_prices_loads_per_tier() -> None:
    hold = TierHold(gpu=0, l1=8192, l2=8192)
    seconds = MODEL.load_s(hold)
    l1 = 8192 * 327_680 / 440e9
    l2 = 0.005 + 8192 * 327_680 / 10e9
    assert seconds == pytest.approx(l1 + l2)
    assert MODEL.load_s(TierHold(gpu=8192)) == 0  # a GPU hit is free


def test_a_prefix_in_l2_makes_direct_on_another_engine_cheaper_than_pd_compute() -> None:
    """Engine A computed the document and wrote it through to L2; a long prompt on decode engine B
    loads it (latency + bytes) instead of a prefill engine recomputing it."""
    n, decode, prefill = 16_000, ep("B", running=8), ep("p", "prefill")
    cold = MODEL.decide(ctx(n, block_size=16), decode, lambda: prefill)
    assert cold.path is Path.PD  # computing it on B would stall B's 8 streams: the prefill pool computes it
    holds = {"B": TierHold(gpu=0, l2=15_984), "p": TierHold(gpu=0, l2=15_984)}
    warm = MODEL.decide(_tiered(n, holds), decode, lambda: prefill)
    assert warm.path is Path.DIRECT and "decode gpu=0 l2=15984" in warm.detail
    direct, pd = MODEL.predict(_tiered(n, holds), decode, prefill)
    assert direct == pytest.approx(16 / 10_000 + MODEL.load_s(holds["B"]))  # the last block, and the load
    assert direct < pd  # P/D would load it too, then hand it over


def _leg(url: str, cached: int) -> LegReport:
    return LegReport(leg="decode", url=url, outcome=LegOutcome.OK, path=Path.DIRECT, seconds=0.1, cached_tokens=cached)


def test_an_answer_that_loaded_less_than_believed_corrects_the_tiers() -> None:
    tiers = TierIndex(l1_capacity=lambda url: 100, l2_capacity=100)
    hashes = list(range(1, 11))
    tiers.stored(A, hashes[2:6], remote=False)  # blocks 3-6 in A's L1
    tiers.stored(A, hashes[6:], remote=True)  # 7-10 in L2
    learner = TierBeliefs(tiers)
    c = _tiered(161, {A: TierHold(gpu=32, l1=64, l2=64)}, block_hashes=hashes)
    learner.on_leg_done(c, _leg(A, cached=64))  # the engine loaded blocks 3 and 4 only
    assert learner.corrected == 6  # blocks 5-10 were not where they were believed
    assert tiers.walk(B, hashes, 6) == (0, 0)  # 7-10 are no longer believed in the shared store
    assert tiers.walk(A, hashes, 0) == (10, 0)  # A computed the whole prompt: its L1 has it now


def test_only_whole_chunks_are_believed_stored() -> None:
    """LMCache keeps 256-token chunks (16 blocks of 16) and drops a prompt's partial last chunk."""
    tiers = TierIndex(l1_capacity=lambda url: 100, chunk_blocks=4)
    tiers.learn(A, list(range(1, 11)))  # 10 blocks: two whole chunks of 4, and 2 blocks left over
    assert tiers.walk(A, list(range(1, 11)), 0) == (8, 0)
