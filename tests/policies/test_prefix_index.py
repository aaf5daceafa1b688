"""PrefixIndex: leading-block matches from two sources, aging, bounds, lifecycle."""

from __future__ import annotations

import random

import pytest

from policies.beliefs.blockhash import HashSpec, block_hashes
from policies.beliefs.prefix_index import IndexStats, PrefixIndex, PrefixStore

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_is_a_prefix_store() -> None:
    assert isinstance(PrefixIndex(), PrefixStore)


def test_match_counts_leading_blocks_only(clock: Clock) -> None:
    idx = PrefixIndex(clock=clock)
    idx.stored(A, [1, 2, 3])
    idx.stored(B, [1, 2])
    idx.stored(B, [4])  # B holds block 4 but not 3: only its leading run counts
    idx.stored(C, [2, 3])  # C lacks block 1: no leading blocks at all
    assert idx.match([1, 2, 3, 4]) == {A: 3, B: 2}
    assert idx.match([9, 1, 2]) == {}
    assert idx.match([]) == {}


def test_approximate_entries_age_out(clock: Clock) -> None:
    idx = PrefixIndex(approx_ttl_s=60, clock=clock)
    idx.learn(A, [1, 2, 3])
    assert idx.match([1, 2, 3, 4]) == {A: 3}
    clock.now += 30
    idx.learn(A, [1])  # refreshes block 1 only
    clock.now += 31
    assert idx.match([1, 2, 3]) == {A: 1}
    clock.now += 60
    assert idx.match([1, 2, 3]) == {}
    idx.learn(B, [7])  # learning prunes what has expired
    assert idx.stats().approximate == 1


def test_approximate_lru_bound(clock: Clock) -> None:
    idx = PrefixIndex(max_approx_entries=5, clock=clock)
    idx.learn(A, [1, 2, 3])
    clock.now += 1
    idx.learn(B, [1, 2, 3])  # 6 entries: A's block 1 (least recently learned) goes
    stats = idx.stats()
    assert stats.approximate == 5
    assert stats.approximate_by_url == {A: 2, B: 3}
    assert idx.match([1, 2, 3]) == {B: 3}


def test_live_feed_trusts_events_after_the_young_window(clock: Clock) -> None:
    idx = PrefixIndex(young_s=5, clock=clock)
    idx.set_precise(A, True)
    idx.learn(A, [1, 2, 3])
    idx.learn(B, [1, 2, 3])  # B has no feed: its history counts for the whole TTL
    assert idx.match([1, 2, 3]) == {A: 3, B: 3}  # young: the BlockStored may not be in yet
    idx.stored(A, [1, 2])
    clock.now += 6
    assert idx.match([1, 2, 3]) == {A: 2, B: 3}  # old: only what the engine said it stored
    idx.removed(A, [2])
    assert idx.match([1, 2, 3]) == {A: 1, B: 3}
    idx.set_precise(A, False)  # feed lost: history counts again
    assert idx.match([1, 2, 3]) == {A: 3, B: 3}
    assert idx.is_precise(B) is False


def test_cleared_and_forget(clock: Clock) -> None:
    idx = PrefixIndex(clock=clock)
    idx.stored(A, [1, 2])
    idx.stored(B, [1, 2])
    idx.learn(A, [5])
    idx.cleared(A)
    assert idx.match([1, 2]) == {B: 2}
    assert idx.match([5]) == {A: 1}  # history is not an engine's cache: cleared keeps it
    idx.set_precise(A, True)
    idx.forget(A)
    assert idx.match([5]) == {}
    assert idx.stats() == IndexStats(approximate=0, precise=2, live_feeds=0, precise_by_url={B: 2})
    idx.cleared("http://unknown")  # no-op
    idx.removed("http://unknown", [1])


def test_stored_twice_and_removed_unknown(clock: Clock) -> None:
    idx = PrefixIndex(clock=clock)
    idx.stored(A, [1, 1, 2])
    idx.stored(A, [1])
    idx.removed(A, [3])
    assert idx.stats().precise == 2
    idx.removed(A, [1, 2])
    assert idx.stats().precise == 0
    assert idx.match([1]) == {}


def test_precise_cap_per_endpoint(clock: Clock) -> None:
    idx = PrefixIndex(max_precise_per_url=3, clock=clock)
    idx.stored(A, [1, 2, 3, 4])
    idx.stored(B, [1])
    assert idx.stats().precise_by_url == {A: 3, B: 1}
    assert idx.precise_evicted == 1
    assert idx.match([1]) == {B: 1}


def test_mixed_sources_chain(clock: Clock) -> None:
    idx = PrefixIndex(clock=clock)
    idx.stored(A, [1])
    idx.learn(A, [2])
    assert idx.match([1, 2, 3]) == {A: 2}


def test_match_8k_prompt_on_a_populated_index() -> None:
    """An 8k-token prompt against an index holding other prompts: each engine's share is exact
    (its speed is measured by bench.decision, not asserted here)."""
    spec = HashSpec(block_size=16)
    rng = random.Random(3)
    idx = PrefixIndex()
    for n in range(8):
        idx.learn(f"http://e{n}", block_hashes([rng.randrange(150_000) for _ in range(8192)], spec))
    prompt = [rng.randrange(150_000) for _ in range(8192)]
    hashes = block_hashes(prompt, spec)
    for url in ("http://e0", "http://e1"):
        idx.stored(url, hashes)
    idx.learn("http://e2", hashes[:300])
    got = idx.match(block_hashes(prompt, spec))
    assert got == {"http://e0": 512, "http://e1": 512, "http://e2": 300}


def test_match_equals_a_naive_walk_on_random_states() -> None:
    """The fast walk gives the same counts as checking every endpoint at every block."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        clock = [1000.0]
        idx = PrefixIndex(approx_ttl_s=50, young_s=5, clock=lambda clock=clock: clock[0])
        urls = [f"http://e{i}" for i in range(4)]
        chain = list(range(30))
        truth: dict[str, set[int]] = {u: set() for u in urls}
        for u in urls:
            if rng.random() < 0.5:
                idx.set_precise(u, True)
            n = rng.randrange(0, 31)
            if rng.random() < 0.5:
                idx.stored(u, chain[:n])
            else:
                idx.learn(u, chain[:n])
            holes = set(rng.sample(range(30), 3)) if rng.random() < 0.3 else set()
            idx.removed(u, [h for h in holes if h < n])
        clock[0] += rng.choice([0, 3, 10, 60])
        for u in urls:
            truth[u] = {h for h in chain if idx.match([h]).get(u)}
        expected = {}
        for u in urls:
            n = 0
            while n < 30 and chain[n] in truth[u]:
                n += 1
            if n:
                expected[u] = n
        assert idx.match(chain) == expected


# -- what an engine can hold bounds what it is believed to hold ---------------------------------


def test_learned_blocks_never_exceed_the_engines_gpu_capacity(clock: Clock) -> None:
    """A flood of long prompts on one engine: only what its GPU cache can hold stays believed (the
    most recently learned), as the engine's own LRU keeps it; the rest is handed down a tier."""
    evicted: list[tuple[str, int]] = []
    idx = PrefixIndex(clock=clock, capacity={A: 8192}.get, on_evict=lambda url, gone: evicted.append((url, len(gone))))
    prompts = [[p * 100_000 + i for i in range(1088)] for p in range(25)]  # 25 x ~17k tokens at 16 per block
    for prompt in prompts:
        clock.now += 1
        idx.learn(A, prompt)
        idx.learn(B, prompt)  # B's capacity is unknown: no bound
    assert idx.stats().approximate_by_url[A] == 8192
    assert idx.match(prompts[0]) == {B: 1088}  # the oldest prompt is gone from A
    assert idx.match(prompts[-1]) == {A: 1088, B: 1088}  # the newest is still there
    assert sum(n for url, n in evicted if url == A) == 25 * 1088 - 8192 and all(url == A for url, _ in evicted)
    assert idx.capacity_evicted == 25 * 1088 - 8192


def test_a_prompt_learned_again_is_the_most_recent_and_survives(clock: Clock) -> None:
    idx = PrefixIndex(clock=clock, capacity=lambda url: 4)
    idx.learn(A, [1, 2, 3])
    clock.now += 1
    idx.learn(A, [7, 8])
    clock.now += 1
    idx.learn(A, [1, 2, 3])  # used again: now the newest, so the older 7, 8 go first
    clock.now += 1
    idx.learn(A, [5])
    assert idx.match([1, 2, 3]) == {A: 3}
    assert idx.match([7, 8]) == {}  # 7 went for room, and 8 is not a leading block without it
