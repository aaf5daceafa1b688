"""PrefixIndex reuses recent learn calls ("runs") in match: the counts must always be those of the
full walk, whatever happened to the index in between (evictions, expiry, KV events, liveness,
forget, a clock going back)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from policies.beliefs.blockhash import BlockHash, HashSpec, block_hashes
from policies.beliefs.prefix_index import PrefixIndex, shared_prefix

A, B = "http://a:8000", "http://b:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counting(PrefixIndex):
    """Counts the blocks ``match`` took from runs instead of walking them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reused = 0

    def _known(self, url: str, hashes: Sequence[BlockHash], now: float) -> int:
        n = super()._known(url, hashes, now)
        self.reused += n
        return n


class FullWalk(PrefixIndex):
    """The same index without run reuse: every match walks every block."""

    def _known(self, url: str, hashes: Sequence[BlockHash], now: float) -> int:
        return 0


def test_next_turn_walks_only_its_new_blocks() -> None:
    clock = Clock()
    idx = Counting(clock=clock)
    turn1 = list(range(100, 140))
    idx.learn(A, turn1)
    turn2 = [*turn1, 500, 501, 502]
    idx.learn(A, turn2[:41])  # the new block 500 is held too
    assert idx.match(turn2) == {A: 41}
    assert idx.reused == 41


def test_eviction_inside_a_run_voids_it() -> None:
    idx = Counting(max_approx_entries=50, clock=Clock())
    turn = list(range(40))
    idx.learn(A, turn)
    idx.learn(A, turn[:5])  # blocks 0..4 move to the LRU's end
    idx.learn(B, list(range(1000, 1015)))  # the bound evicts the 5 oldest: A's blocks 5..9
    assert idx.match([*turn, 99]) == {A: 5}
    assert idx.reused == 5  # from the second call's run; the first one's is void


def test_expiry_liveness_forget_and_clock() -> None:
    clock = Clock()
    idx = Counting(approx_ttl_s=60, young_s=5, clock=clock)
    turn = list(range(30))
    idx.learn(A, turn)
    clock.now += 61
    assert idx.match(turn) == {}  # expired: the run proves nothing
    idx.learn(A, turn)
    idx.set_precise(A, True)
    clock.now += 6
    assert idx.match(turn) == {}  # a live feed's learned entries only count while young
    idx.stored(A, turn[:10])
    assert idx.match(turn) == {A: 10}
    idx.set_precise(A, False)
    assert idx.match(turn) == {A: 30}
    idx.forget(A)
    assert idx.match(turn) == {}
    idx.learn(A, turn)
    clock.now -= 100  # a clock going back
    idx.learn(B, turn[:3])
    assert idx.match(turn) == {A: 30, B: 3}


def test_shared_prefix_of_chained_and_hand_made_hashes() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(0, 12)
        a = [rng.randrange(3) for _ in range(n)]  # not chained: equal items anywhere
        b = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert shared_prefix(a, b) == want, (a, b)
    spec = HashSpec(block_size=4)
    ids = [rng.randrange(1000) for _ in range(200)]
    chain = block_hashes(ids, spec)
    branch = block_hashes([*ids[:101], 7, *ids[102:]], spec)
    assert shared_prefix(chain, branch) == 25 and shared_prefix(chain, chain[:30]) == 30


def test_reuse_gives_the_full_walks_counts_on_random_histories() -> None:  # noqa: C901 - over the limit before it was set; to split
    """Conversations growing turn by turn on a small, busy index: after every operation, match
    with runs equals match without (a twin fed the same operations) on every conversation."""
    rng = random.Random(11)
    reused = 0
    for trial in range(40):
        clock = Clock()
        kwargs: dict[str, Any] = {
            "max_approx_entries": rng.choice([40, 120, 400]),
            "approx_ttl_s": 50.0,
            "young_s": 5.0,
            "max_precise_per_url": rng.choice([30, 1000]),
            "clock": clock,
        }
        fast, full = Counting(**kwargs), FullWalk(**kwargs)
        urls = [f"http://e{i}" for i in range(3)]
        system = [rng.randrange(1 << 30) for _ in range(4)]
        chats: list[list[int]] = []
        for _ in range(250):
            op = rng.random()
            if op < 0.35 or not chats:  # a new turn of some conversation (or a new one), routed
                if chats and rng.random() < 0.8:
                    k = rng.randrange(len(chats))
                    base = chats[k]
                    if rng.random() < 0.2:  # edited history: a branch off an earlier block
                        base = base[: rng.randrange(len(base) + 1)]
                    chats[k] = base + [rng.randrange(1 << 30) for _ in range(rng.randrange(1, 6))]
                    hashes = chats[k]
                else:
                    hashes = system[: rng.randrange(len(system) + 1)] + [
                        rng.randrange(1 << 30) for _ in range(rng.randrange(1, 15))
                    ]
                    chats.append(hashes)
                for url in rng.sample(urls, rng.randrange(1, 3)):
                    n = len(hashes) if rng.random() < 0.8 else rng.randrange(len(hashes) + 1)
                    for idx in (fast, full):
                        idx.learn(url, hashes[:n])
            elif op < 0.5:
                url, chat = rng.choice(urls), rng.choice(chats)
                part = chat[rng.randrange(len(chat)) :][: rng.randrange(1, 8)]
                for idx in (fast, full):
                    idx.stored(url, part)
            elif op < 0.6:
                url, chat = rng.choice(urls), rng.choice(chats)
                gone = rng.sample(chat, min(len(chat), rng.randrange(1, 4)))
                for idx in (fast, full):
                    idx.removed(url, gone)
            elif op < 0.65:
                url, live = rng.choice(urls), rng.random() < 0.5
                for idx in (fast, full):
                    idx.set_precise(url, live)
            elif op < 0.68:
                url, forget = rng.choice(urls), rng.random() < 0.5
                for idx in (fast, full):
                    (idx.forget if forget else idx.cleared)(url)
            elif op < 0.8:
                clock.now += rng.choice([0.5, 2.0, 4.0, 6.0, 20.0, 55.0])
            elif op < 0.81:
                clock.now -= 1.0
            for chat in chats:
                query = [*chat, rng.randrange(1 << 30)] if rng.random() < 0.5 else chat
                assert fast.match(query) == full.match(query), (trial, query)
        assert fast.stats() == full.stats()
        assert fast._run_blocks <= fast.max_run_blocks
        reused += fast.reused
    assert reused > 1000  # the runs were really used, not skipped


def test_runs_are_bounded() -> None:
    idx = PrefixIndex(max_approx_entries=100)
    for n in range(50):
        idx.learn(A, [n * 1000 + i for i in range(30)])
    assert idx._run_blocks <= 200
    assert sum(len(r.hashes) for runs in idx._runs.values() for r in runs) == idx._run_blocks
