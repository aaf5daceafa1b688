"""Which engine holds which prefix-cache blocks: one index fed by two sources.

- **approximate**: what the gateway itself routed (``learn``): after sending a prompt to an
  engine, that engine very likely holds the prompt's blocks for a while. Entries age out
  (``approx_ttl_s``) and the whole source is LRU-bounded (``max_approx_entries``), so memory
  stays flat whatever the traffic.
- **precise**: the engine's own KV cache events (``stored`` / ``removed`` / ``cleared``, fed by
  ``gateway/kvevents.py``). For an endpoint whose event feed is live (``set_precise(url, True)``)
  its approximate entries only count while young (``young_s``: the lag between routing a prompt
  and the engine's BlockStored for it); after that the events are the truth.

Keys are the block hashes of ``policies/blockhash.py``: chained, so holding block ``i`` of a
prompt means holding the whole prefix up to it, and ``match`` only has to walk the prompt's hashes
until no endpoint holds the next one.

Everything here runs on the gateway's event loop (no locks). ``PrefixStore`` is the interface the
routing code depends on, so a shared (Redis-backed) index can replace this in-memory one.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from policies.blockhash import BlockHash


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
    entries): the approximate bound (200k entries by default) keeps that source near 50 MB.
    Precise entries are bounded by the engines' own cache sizes (a few tens of thousands of
    blocks each); the per-endpoint cap only guards against a feed that loses its BlockRemoved
    events, and evicts that endpoint's oldest stored blocks.
    """

    def __init__(
        self,
        *,
        max_approx_entries: int = 200_000,
        approx_ttl_s: float = 600.0,
        young_s: float = 5.0,
        max_precise_per_url: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_approx_entries <= 0 or max_precise_per_url <= 0:
            raise ValueError("entry bounds must be positive")
        self.max_approx_entries = max_approx_entries
        self.approx_ttl_s = approx_ttl_s
        self.young_s = young_s
        self.max_precise_per_url = max_precise_per_url
        self._clock = clock
        # approximate: LRU over (url, hash) -> time learned; oldest first
        self._approx: OrderedDict[tuple[str, BlockHash], float] = OrderedDict()
        self._approx_by_hash: dict[BlockHash, dict[str, float]] = {}
        self._approx_count: Counter[str] = Counter()
        # precise: per endpoint, its blocks in store order (for the safety cap); hash -> holders
        self._precise: dict[str, OrderedDict[BlockHash, None]] = {}
        self._precise_by_hash: dict[BlockHash, set[str]] = {}
        self._live: set[str] = set()
        self.precise_evicted = 0  # entries dropped by the safety cap (a feed losing removals)

    # -- lookups ---------------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        # The first block names the candidates; after it, only those still matching are checked,
        # one or two dict lookups each: a returning 8k-token conversation walks ~500 blocks.
        if not hashes:
            return {}
        now = self._clock()
        young, ttl, live = self.young_s, self.approx_ttl_s, self._live
        precise, approx = self._precise_by_hash, self._approx_by_hash

        def fresh(url: str, ts: float | None) -> bool:
            return ts is not None and now - ts <= (young if url in live else ttl)

        first_p, first_a = precise.get(hashes[0]), approx.get(hashes[0])
        alive = list(first_p or ())
        alive += [u for u, ts in (first_a or {}).items() if u not in alive and fresh(u, ts)]
        if len(alive) == 1:  # the common case (a conversation on its engine): one tight loop
            return {alive[0]: self._run_of(alive[0], hashes, now)}
        counts: dict[str, int] = {}
        n = 1 if alive else 0
        for h in hashes[1:] if alive else ():
            p, a = precise.get(h), approx.get(h)
            if p is None and a is None:
                break
            still = [u for u in alive if (p is not None and u in p) or (a is not None and fresh(u, a.get(u)))]
            if len(still) != len(alive):
                for u in alive:
                    if u not in still:
                        counts[u] = n
                alive = still
                if not alive:
                    break
            n += 1
        for u in alive:
            counts[u] = n
        return counts

    def _run_of(self, url: str, hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading blocks ``url`` holds (it holds the first)."""
        precise, approx = self._precise_by_hash, self._approx_by_hash
        limit = self.young_s if url in self._live else self.approx_ttl_s
        n = 1
        for h in hashes[1:]:
            p = precise.get(h)
            if p is None or url not in p:
                a = approx.get(h)
                ts = a.get(url) if a is not None else None
                if ts is None or now - ts > limit:
                    break
            n += 1
        return n

    # -- approximate source ----------------------------------------------------------------------

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        now = self._clock()
        entries, by_hash = self._approx, self._approx_by_hash
        for h in hashes:
            key = (url, h)
            if key in entries:
                entries.move_to_end(key)
            else:
                self._approx_count[url] += 1
            entries[key] = now
            holders = by_hash.get(h)
            if holders is None:
                by_hash[h] = {url: now}
            else:
                holders[url] = now
        self._expire_approx(now)

    def _expire_approx(self, now: float) -> None:
        """Drop entries past the TTL (they sit at the front) and beyond the size bound."""
        entries = self._approx
        while entries:
            key, ts = next(iter(entries.items()))
            if len(entries) <= self.max_approx_entries and now - ts <= self.approx_ttl_s:
                break
            entries.popitem(last=False)
            self._drop_approx(key)

    def _drop_approx(self, key: tuple[str, BlockHash]) -> None:
        url, h = key
        holders = self._approx_by_hash.get(h)
        if holders is not None:
            holders.pop(url, None)
            if not holders:
                del self._approx_by_hash[h]
        self._approx_count[url] -= 1
        if self._approx_count[url] <= 0:
            del self._approx_count[url]

    # -- precise source --------------------------------------------------------------------------

    def stored(self, url: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._precise.get(url)
        if mine is None:
            mine = self._precise[url] = OrderedDict()
        by_hash = self._precise_by_hash
        for h in hashes:
            if h in mine:
                mine.move_to_end(h)
                continue
            mine[h] = None
            holders = by_hash.get(h)
            if holders is None:
                by_hash[h] = {url}
            else:
                holders.add(url)
        while len(mine) > self.max_precise_per_url:
            h, _ = mine.popitem(last=False)
            self._unhold(url, h)
            self.precise_evicted += 1

    def removed(self, url: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._precise.get(url)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                del mine[h]
                self._unhold(url, h)

    def _unhold(self, url: str, h: BlockHash) -> None:
        holders = self._precise_by_hash.get(h)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._precise_by_hash[h]

    def cleared(self, url: str) -> None:
        mine = self._precise.pop(url, None)
        for h in mine or ():
            self._unhold(url, h)

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
        if self._approx_count.get(url):
            for key in [k for k in self._approx if k[0] == url]:
                del self._approx[key]
                self._drop_approx(key)

    def stats(self) -> IndexStats:
        return IndexStats(
            approximate=len(self._approx),
            precise=sum(len(m) for m in self._precise.values()),
            live_feeds=len(self._live),
            approximate_by_url=dict(self._approx_count),
            precise_by_url={url: len(m) for url, m in self._precise.items() if m},
        )
