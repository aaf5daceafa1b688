"""What the gateway believes each engine holds in its prefix cache, learned from requests.

Beliefs go through three states, driven by the lifecycle hooks:

- **tentative** (``on_routed``): the prompt is on its way to its engines; it counts as cached there
  at once, so a burst sharing a prefix follows the first request, but it lives only in
  ``InFlightPrefixes`` until the leg ends;
- **confirmed** (``on_leg_done``, the engine computed or received the prompt's KV): it moves to the
  prefix index (and the shared state, for other replicas), where it ages as learned entries do;
- **retracted** (the leg was refused, never reached the engine, or failed before the first token):
  it is dropped, and the prompt never counts as cached there.

The engine's own answer then corrects the index: when it served fewer tokens from its cache than
the gateway had settled on (its usage's ``cached_tokens``), the blocks found gone are the oldest
the engine still had on record, and an engine evicts least recently used blocks first, so
everything the gateway learned on it at or before that block's time goes too. An engine that
restarted, or runs without prefix caching, is handled by ``forget`` and ``caching_off``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from policies.base import Decision, Finished, LegReport, Path, RequestContext
from policies.beliefs.blockhash import BlockHash
from policies.beliefs.prefix_index import PrefixIndex, shared_prefix

log = logging.getLogger(__name__)


class SharedPrefixes(Protocol):
    """Learned blocks shared with other gateway replicas (gateway/cluster/redis_state.py's RedisState)."""

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None: ...

    def forget(self, url: str, until: float) -> None:
        """Entries of ``url`` learned at or before ``until`` (unix time) no longer count."""
        ...


class InFlightPrefixes:
    """Prompts on their way to an engine, counted as held there until their leg ends.

    Kept as the prompts' own hash lists, keyed by (first block, engine): adding and removing one
    costs O(1) whatever its length, and a lookup compares the prompt with each in-flight prompt
    that starts like it (a binary search on chained hashes)."""

    def __init__(self) -> None:
        self._by_first: dict[BlockHash, dict[str, list[Sequence[BlockHash]]]] = {}

    def __len__(self) -> int:
        return sum(len(runs) for holders in self._by_first.values() for runs in holders.values())

    def add(self, url: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self._by_first.setdefault(hashes[0], {}).setdefault(url, []).append(hashes)

    def remove(self, url: str, hashes: Sequence[BlockHash]) -> None:
        holders = self._by_first.get(hashes[0]) if hashes else None
        runs = holders.get(url) if holders else None
        if not holders or not runs:
            return
        for i, run in enumerate(runs):
            if run is hashes:  # this request's own list, not an equal one of another request
                del runs[i]
                break
        if not runs:
            del holders[url]
            if not holders:
                del self._by_first[hashes[0]]

    def extend(self, hashes: Sequence[BlockHash], blocks: dict[str, int]) -> dict[str, int]:
        """``blocks`` (leading blocks held per engine) raised by what is in flight to each engine."""
        holders = self._by_first.get(hashes[0]) if hashes else None
        if not holders:
            return blocks
        out = dict(blocks)
        for url, runs in holders.items():
            best = max(shared_prefix(hashes, run) for run in runs)
            if best > out.get(url, 0):
                out[url] = best
        return out

    def forget(self, url: str) -> None:
        for first in list(self._by_first):
            holders = self._by_first[first]
            holders.pop(url, None)
            if not holders:
                del self._by_first[first]


class PrefixBeliefs:
    """The prefix-cache learner: a ``Lifecycle`` subscriber that owns learned prefix entries."""

    def __init__(
        self,
        index: PrefixIndex,
        in_flight: InFlightPrefixes | None = None,
        shared: SharedPrefixes | None = None,
        caching_off: Callable[[str], bool] = lambda url: False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.in_flight = in_flight if in_flight is not None else InFlightPrefixes()
        self.shared = shared
        self._caching_off = caching_off
        self._clock, self._wall = clock, wall
        self._open: dict[int, list[str]] = {}  # per request (its context's id): engines with tentative entries
        self.evicted = 0  # learned entries dropped because an engine's answer showed them gone

    def on_routed(self, ctx: RequestContext, decision: Decision) -> None:
        hashes = ctx.block_hashes
        if not hashes:
            return
        urls = [decision.decode.url]
        if decision.path is Path.PD and decision.prefill is not None:
            urls.append(decision.prefill.url)
        opened = [url for url in urls if not self._caching_off(url)]
        for url in opened:
            self.in_flight.add(url, hashes)
        if opened:
            self._open[id(ctx)] = opened

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        hashes = ctx.block_hashes
        if not hashes:
            return
        opened = self._open.get(id(ctx))
        if opened and leg.url in opened:
            opened.remove(leg.url)
            self.in_flight.remove(leg.url, hashes)
        if not leg.prefilled or self._caching_off(leg.url):
            return  # retracted: the engine may never have cached the prompt
        if leg.cached_tokens is not None and ctx.block_size:
            self._correct(ctx, leg.url, leg.cached_tokens)
        self.index.learn(leg.url, hashes)  # confirmed: the engine computed or received every block
        if self.shared is not None:
            self.shared.learn(leg.url, hashes)

    def on_finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        for url in self._open.pop(id(ctx), ()):  # engines whose leg never ran (client gone, fallback)
            self.in_flight.remove(url, ctx.block_hashes)

    def _correct(self, ctx: RequestContext, url: str, reported: int) -> None:
        """The engine served ``reported`` tokens from its cache; fewer than the settled belief
        means blocks it was believed to hold are gone (evicted, or the engine lost its cache)."""
        bs = ctx.block_size
        if reported + bs > ctx.settled(url):
            return
        at = self.index.learned_at(url, ctx.block_hashes[reported // bs])
        if at is None:  # known from KV events or another replica: those sources correct themselves
            return
        dropped = self.index.forget_learned_until(url, at)
        self.evicted += dropped
        if self.shared is not None:
            self.shared.forget(url, self._wall() - (self._clock() - at))
        log.info(
            "%s served %d cached prompt tokens where %d were believed; dropped %d learned blocks as old or older",
            url,
            reported,
            ctx.settled(url),
            dropped,
        )

    def forget(self, url: str) -> None:
        """``url``'s engine restarted (or left): nothing learned about its cache holds any more."""
        self.index.cleared(url)
        self.index.forget_learned_until(url, math.inf)
        if self.shared is not None:
            self.shared.forget(url, self._wall())
