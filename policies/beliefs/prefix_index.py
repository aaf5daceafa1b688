"""Which engine holds which prefix-cache blocks: one index fed by two sources.

- **approximate**: what the gateway itself routed (``learn``): after sending a prompt to an
  engine, that engine very likely holds the prompt's blocks for a while. Entries age out
  (``approx_ttl_s``) and the whole source is LRU-bounded (``max_approx_entries``), so memory
  stays flat whatever the traffic. Per endpoint, they never exceed what its GPU cache can hold
  (``capacity``: the engine's reported ``num_gpu_blocks``): past that, its least recently
  learned blocks go first, as the engine's own LRU evicts them, and ``on_evict`` hears of them
  (the tier beliefs take them down a tier when the engine has one).
- **precise**: the engine's own KV cache events (``stored`` / ``removed`` / ``cleared``, fed by
  ``gateway/engines/kvevents.py``). For an endpoint whose event feed is live (``set_precise(url, True)``)
  its approximate entries only count while young (``young_s``: the lag between routing a prompt
  and the engine's BlockStored for it); after that the events are the truth.

Keys are the block hashes of ``policies/beliefs/blockhash.py``: chained, so holding block ``i`` of a
prompt means holding the whole prefix up to it, and ``match`` only has to walk the prompt's hashes
until no endpoint holds the next one.

A conversation's next turn starts with the blocks its previous turn was routed with, which
``learn`` has just given to the endpoints it went to. Each ``learn`` is remembered as a *run*
(its hashes, when, and its sequence number); while no entry from that call can have gone (the
LRU evicts in call order, so a watermark of the newest evicted call tells) and they are still
fresh, ``match`` takes the blocks shared with the run as held and walks only the rest: the same
counts as the full walk, for a fraction of its cost.

Everything here runs on the gateway's event loop (no locks). ``PrefixStore`` is the interface the
routing code depends on, so a shared (Redis-backed) index can replace this in-memory one.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Protocol, runtime_checkable

from policies.beliefs.blockhash import BlockHash


@dataclass(frozen=True, slots=True)
class _Run:
    """One ``learn`` call: its hashes (a private copy), its sequence number, when."""

    hashes: list[BlockHash]
    seq: int
    at: float


def shared_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """How many leading hashes ``a`` and ``b`` share. Chained hashes diverge once for good, which
    a binary search on single items finds; one slice comparison then proves it (any inputs)."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # the longest shared prefix if equal items imply equal prefixes
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    head = b[:lo] if type(b) is list else list(b[:lo])
    if list(a[:lo]) == head and (lo == n or a[lo] != b[lo]):
        return lo
    for i in range(n):  # not a chain (only hand-made hashes): item by item
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Entry counts for metrics: one entry is one (endpoint, block) pair."""

    approximate: int
    precise: int
    live_feeds: int
    approximate_by_url: dict[str, int] = field(default_factory=dict)
    precise_by_url: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class PrefixStore(Protocol):
    """What routing needs from a prefix index (in-memory here; shared implementations later)."""

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each endpoint holding the prompt's first block: how many leading blocks it holds."""
        ...

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        """The gateway routed a prompt with these block hashes to ``url``."""
        ...

    def stored(self, url: str, hashes: Iterable[BlockHash]) -> None: ...

    def removed(self, url: str, hashes: Iterable[BlockHash]) -> None: ...

    def cleared(self, url: str) -> None:
        """The engine dropped its whole prefix cache (AllBlocksCleared, restart, lost events)."""
        ...

    def set_precise(self, url: str, live: bool) -> None:
        """Whether ``url`` has a live KV event feed (its events, not history, are the truth)."""
        ...

    def forget(self, url: str) -> None:
        """``url`` left the configuration: drop everything about it."""
        ...

    def stats(self) -> IndexStats: ...


class PrefixIndex:
    """The in-memory ``PrefixStore``.

    Memory: roughly 250 bytes per entry on CPython (an 8k-token prompt at block size 16 is 512
    entries): the approximate bound (200k entries by default) keeps that source near 50 MB. The
    runs of recent learn calls hold at most twice as many hashes (a list slot each, ~8 bytes, plus
    hashes already evicted from the index).
    Precise entries are bounded by the engines' own cache sizes (a few tens of thousands of
    blocks each); the per-endpoint cap (``max_precise_per_url``, ~200 bytes an entry) guards
    against a feed that loses its BlockRemoved events or publishes blocks no engine holds, and
    evicts that endpoint's oldest stored blocks. Each endpoint's entries are one ordered dict and
    nothing else (``match`` asks each endpoint with entries for the first block): a clear drops the
    dict whole, and eviction and removal run as one C loop each (``_drain``), so even a full
    endpoint costs milliseconds, not a Python step per entry.
    """

    RUNS_PER_KEY = 8  # runs kept per (endpoint, first block): conversations sharing a system prompt

    def __init__(
        self,
        *,
        max_approx_entries: int = 200_000,
        approx_ttl_s: float = 600.0,
        young_s: float = 5.0,
        max_precise_per_url: int = 262_144,
        clock: Callable[[], float] = time.monotonic,
        capacity: Callable[[str], int | None] = lambda url: None,
        on_evict: Callable[[str, list[BlockHash]], None] | None = None,
    ) -> None:
        if max_approx_entries <= 0 or max_precise_per_url <= 0:
            raise ValueError("entry bounds must be positive")
        self.max_approx_entries = max_approx_entries
        self.approx_ttl_s = approx_ttl_s
        self.young_s = young_s
        self.max_precise_per_url = max_precise_per_url
        self._clock = clock
        self.capacity = capacity  # blocks an endpoint's GPU cache holds (None: unknown, no bound)
        self.on_evict = on_evict  # learned blocks dropped for room, oldest first
        self.capacity_evicted = 0  # learned entries dropped because the engine could not hold them
        # approximate: LRU over (url, hash) -> the learn call's sequence number, oldest first; per
        # endpoint, hash -> time learned (what match walks: one lookup per block, no key to build)
        self._approx: OrderedDict[tuple[str, BlockHash], int] = OrderedDict()
        self._approx_of: dict[str, dict[BlockHash, float]] = {}
        self._seq = 0  # learn calls so far
        self._evicted_seq = 0  # the newest learn call an evicted entry came from
        self._last_learn = float("-inf")
        # recent learn calls by (url, first hash), newest first, bounded by the hashes they hold
        self._runs: OrderedDict[tuple[str, BlockHash], list[_Run]] = OrderedDict()
        self._run_blocks = 0
        self.max_run_blocks = 2 * max_approx_entries  # runs overlap (turns of one conversation)
        # precise: per endpoint, its blocks in store order (for the safety cap)
        self._precise: dict[str, OrderedDict[BlockHash, None]] = {}
        self._live: set[str] = set()
        self.precise_evicted = 0  # entries dropped by the safety cap (a feed losing removals)

    # -- lookups ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        # The first block names the candidates; each one's blocks are then walked on their own,
        # after those a recent learn call proves held (``_known``).
        if not hashes:
            return {}
        now = self._clock()
        first = hashes[0]
        alive = [url for url, stored in self._precise.items() if first in stored]
        for url, learned in self._approx_of.items():
            ts = learned.get(first)
            if ts is not None and ts >= now - self._limit(url) and url not in alive:
                alive.append(url)
        counts = {}
        for url in alive:
            known = self._known(url, hashes, now)
            counts[url] = known + self._run_of(url, islice(hashes, known, None) if known else hashes, now)
        return counts

    def _known(self, url: str, hashes: Sequence[BlockHash], now: float) -> int:
        """Leading blocks of ``hashes`` that ``url`` holds by a recent ``learn`` call: every entry
        that call made is still there (no entry of it or of a later call was evicted; ``forget``
        drops the endpoint's runs) and fresh (entries are only ever refreshed to later times)."""
        runs = self._runs.get((url, hashes[0]))
        if not runs:
            return 0
        cutoff = now - self._limit(url)
        best = 0
        for run in runs:
            if run.seq > self._evicted_seq and cutoff <= run.at <= now and len(run.hashes) > best:
                best = max(best, shared_prefix(hashes, run.hashes))
        return best

    def _limit(self, url: str) -> float:
        """How long a learned entry of ``url`` counts: only while young if its events are the truth."""
        return self.young_s if url in self._live else self.approx_ttl_s

    def _run_of(self, url: str, hashes: Iterable[BlockHash], now: float) -> int:
        """How many leading blocks ``url`` holds: stored ones, or ones learned at most
        ``_limit(url)`` ago. One lookup in the endpoint's own (smaller, cache-friendlier) dicts per
        block; a loop per combination keeps the per-block work minimal."""
        learned = self._approx_of.get(url)
        stored = self._precise.get(url)
        cutoff = now - self._limit(url)
        n = 0
        if learned and stored:
            for h in hashes:
                if h not in stored:
                    ts = learned.get(h)
                    if ts is None or ts < cutoff:
                        break
                n += 1
        elif learned:
            for h in hashes:
                ts = learned.get(h)
                if ts is None or ts < cutoff:
                    break
                n += 1
        elif stored:
            for h in hashes:
                if h not in stored:
                    break
                n += 1
        return n

    # -- approximate source ----------------------------------------------------------------------

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        # It runs on the event loop per request: the least work per block.
        if not hashes:
            return
        now = self._clock()
        if now < self._last_learn:  # a clock that went back: runs' times prove nothing
            self._drop_runs(lambda key: True)
        self._last_learn = now
        self._seq = seq = self._seq + 1
        entries = self._approx
        move = entries.move_to_end
        for key in zip(repeat(url), hashes):
            if key in entries:
                move(key)
            entries[key] = seq
        learned = self._approx_of.get(url)
        if learned is None:
            learned = self._approx_of[url] = {}
        cap = self.capacity(url)
        if cap is not None:  # most recently learned last (the engine's LRU order): re-insert
            _drain(map(learned.pop, hashes, repeat(None)))
        learned.update(zip(hashes, repeat(now)))
        self._add_run(url, _Run(list(hashes), seq, now))
        if cap is not None and len(learned) > cap:
            self._evict_for_room(url, learned, len(learned) - cap)
        self._expire_approx(now)

    def _evict_for_room(self, url: str, learned: dict[BlockHash, float], over: int) -> None:
        """Drop ``url``'s ``over`` least recently learned blocks: its GPU cache cannot hold more.
        Runs learned at or before the newest dropped one prove nothing any more."""
        gone = list(islice(learned, over))
        until = max(learned[h] for h in gone)
        for h in gone:
            del learned[h]
            del self._approx[(url, h)]
        self.capacity_evicted += len(gone)
        self._drop_runs_until(url, until)
        if self.on_evict is not None:
            self.on_evict(url, gone)

    def _drop_runs_until(self, url: str, until: float) -> None:
        """``url``'s runs learned at or before ``until`` prove nothing any more (entries went)."""
        for key in [k for k in self._runs if k[0] == url]:
            runs = self._runs[key]
            kept = [r for r in runs if r.at > until]
            self._run_blocks -= sum(len(r.hashes) for r in runs) - sum(len(r.hashes) for r in kept)
            if kept:
                self._runs[key] = kept
            else:
                del self._runs[key]

    def _add_run(self, url: str, run: _Run) -> None:
        """Remember a learn call, in place of the runs it covers (the conversation's earlier turns)."""
        key = (url, run.hashes[0])
        runs = self._runs.pop(key, [])
        kept = [r for r in runs if shared_prefix(run.hashes, r.hashes) < len(r.hashes)][: self.RUNS_PER_KEY - 1]
        self._run_blocks += len(run.hashes) - sum(len(r.hashes) for r in runs) + sum(len(r.hashes) for r in kept)
        self._runs[key] = [run, *kept]
        while self._run_blocks > self.max_run_blocks and self._runs:
            _, dropped = self._runs.popitem(last=False)
            self._run_blocks -= sum(len(r.hashes) for r in dropped)

    def _drop_runs(self, which: Callable[[tuple[str, BlockHash]], bool]) -> None:
        for key in [k for k in self._runs if which(k)]:
            self._run_blocks -= sum(len(r.hashes) for r in self._runs.pop(key))

    def _expire_approx(self, now: float) -> None:
        """Drop entries beyond the size bound and past the TTL (both from the front: the oldest)."""
        entries, approx_of, ttl = self._approx, self._approx_of, self.approx_ttl_s
        over = len(entries) - self.max_approx_entries
        evicted = self._evicted_seq
        while entries:
            if over <= 0:
                url, h = next(iter(entries))
                if now - approx_of[url][h] <= ttl:
                    break
            (url, h), seq = entries.popitem(last=False)
            over -= 1
            if seq > evicted:
                evicted = seq
            learned = approx_of[url]
            del learned[h]
            if not learned:
                del approx_of[url]
        self._evicted_seq = evicted

    def learned_at(self, url: str, h: BlockHash) -> float | None:
        """When ``url`` was last routed a prompt with block ``h`` (None: not a learned entry now)."""
        learned = self._approx_of.get(url)
        return learned.get(h) if learned else None

    def forget_learned_until(self, url: str, until: float) -> int:
        """Drop what ``url`` learned at or before ``until`` (its engine evicts least recently used
        blocks first: one that was found gone takes the older ones with it); returns how many.
        Runs of later learn calls stay valid: their entries are all newer than ``until``."""
        learned = self._approx_of.get(url)
        if not learned:
            return 0
        old = [h for h, ts in learned.items() if ts <= until]
        for h in old:
            del learned[h]
            del self._approx[(url, h)]
        if not learned:
            del self._approx_of[url]
        self._drop_runs_until(url, until)
        return len(old)

    # -- precise source --------------------------------------------------------------------------

    def stored(self, url: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._precise.get(url)
        if mine is None:
            mine = self._precise[url] = OrderedDict()
        for h in hashes:
            if h in mine:
                mine.move_to_end(h)
            else:
                mine[h] = None
        over = len(mine) - self.max_precise_per_url
        if over > 0:  # the oldest stored go first
            _drain(map(mine.popitem, repeat(False, over)))
            self.precise_evicted += over

    def removed(self, url: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._precise.get(url)
        if mine:
            _drain(map(mine.pop, hashes, repeat(None)))

    def cleared(self, url: str) -> None:
        self._precise.pop(url, None)

    def set_precise(self, url: str, live: bool) -> None:
        if live:
            self._live.add(url)
        else:
            self._live.discard(url)

    def is_precise(self, url: str) -> bool:
        return url in self._live

    # -- lifecycle and metrics -------------------------------------------------------------------

    def forget(self, url: str) -> None:
        self.cleared(url)
        self._live.discard(url)
        if self._approx_of.pop(url, None):
            for key in [k for k in self._approx if k[0] == url]:
                del self._approx[key]
        self._drop_runs(lambda key: key[0] == url)

    def stats(self) -> IndexStats:
        return IndexStats(
            approximate=len(self._approx),
            precise=sum(len(m) for m in self._precise.values()),
            live_feeds=len(self._live),
            approximate_by_url={url: len(learned) for url, learned in self._approx_of.items()},
            precise_by_url={url: len(m) for url, m in self._precise.items() if m},
        )


def _drain(calls: Iterable[object]) -> None:
    """Run an iterator of calls to its end in C (a zero-length deque), not a Python step each."""
    deque(calls, maxlen=0)
