"""Beliefs about the KV tiers below the GPU: each engine's CPU tier (L1) and the shared store (L2).

With LMCache (or vLLM's own CPU offload) behind the engines, a prompt prefix the GPU cache has
evicted is not necessarily recomputed: the engine loads it from its CPU RAM (L1) or from a store
every engine reaches (L2: Redis, an LMCache server, S3, Mooncake), at a cost per token far below
prefill's (docs/kv-tiers.md has the figures). ``TierIndex`` holds which blocks are believed where:

- **L1, per engine**: blocks the engine's KV events report with a CPU or storage medium that is
  local to it, blocks learned when the gateway routed a prompt there (the tier stores what the
  engine computes), and blocks the GPU beliefs drop for room (``demote``: down a tier, as the
  engine's own offload does). Bounded by the tier's size (``l1_capacity``: configured, or the
  engine's reported ``num_cpu_blocks``), least recently used out first; without a known size
  nothing is learned into it (events still count, under a safety cap).
- **L2, shared**: blocks reported with ``locality`` REMOTE (vLLM 0.32's events say where a tier
  lies relative to the engine that publishes), or learned when ``l2_learn`` is on (LMCache writes
  what an engine computes through to its remote backend). Any engine can load them; bounded by
  ``l2_capacity`` blocks, least recently used out first.

Learned entries age out after ``ttl_s``; reported ones stay until removed. A restart of an engine
drops its L1 (``forget``) and leaves L2 alone: the store outlives the engine.

``walk`` answers how far past its GPU hit an engine can load a prompt: block by block, each from
L1 or else L2, as LMCache retrieves a prefix chunk by chunk from whichever backend holds it,
stopping at the first block no tier holds.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from policies.base import LegReport, RequestContext
from policies.beliefs.blockhash import BlockHash
from policies.data import Key

L1_SAFETY_BLOCKS = 1 << 20  # an engine's reported L1 entries without a known size (a feed losing removals)
TIERS_NAMES = ("gpu", "l1", "l2")


@dataclass(frozen=True, slots=True)
class TierHold:
    """Leading prompt tokens an endpoint is believed to have, by tier, in prompt order: the first
    ``gpu`` in its GPU prefix cache, the next ``l1`` in its CPU tier, then ``l2`` in the shared store."""

    gpu: int = 0
    l1: int = 0
    l2: int = 0

    @property
    def loaded(self) -> int:
        """Tokens the engine loads from a tier below the GPU instead of computing them."""
        return self.l1 + self.l2

    @property
    def held(self) -> int:
        return self.gpu + self.l1 + self.l2


# Published by the router for each request (``gateway/request/router.py``): each endpoint's tier
# breakdown. Without it (no tiers configured), an endpoint holds only its GPU hit.
TIERS = Key[Mapping[str, TierHold]]("tiers", "leading prompt tokens per endpoint by KV tier (GPU, L1, L2)")


@dataclass(frozen=True, slots=True)
class TierStats:
    l1_by_url: dict[str, int]
    l2: int
    demoted: int  # GPU beliefs handed down to L1
    evicted: int  # tier entries dropped for room


class TierIndex:
    """Which blocks each engine's L1 and the shared L2 are believed to hold. Runs on the event loop."""

    def __init__(
        self,
        *,
        l1_capacity: Callable[[str], int | None] = lambda url: None,
        l2_capacity: int = 0,
        l2_learn: bool = False,
        chunk_blocks: int = 1,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.l1_capacity = l1_capacity
        self.l2_capacity = l2_capacity
        self.l2_learn = l2_learn
        self.chunk_blocks = chunk_blocks  # a tier keeps whole chunks only (LMCache: 256 tokens, 16 blocks)
        self.ttl_s = ttl_s
        self._clock = clock
        # block -> until when it counts (inf: reported by the engine), least recently used first
        self._l1: dict[str, OrderedDict[BlockHash, float]] = {}
        self._l2: OrderedDict[BlockHash, float] = OrderedDict()
        self.demoted = 0
        self.evicted = 0
        # engines whose own hit counters showed they do not load what they were believed to hold
        # (``tier_audit.TierCounterCheck``): nothing below the GPU counts for them
        self._distrusted: set[str] = set()

    # -- what the engines report (KV events by medium) ---------------------------------------------

    def stored(self, url: str, hashes: Iterable[BlockHash], *, remote: bool) -> None:
        if remote:
            self._put(self._l2, hashes, math.inf, self._l2_bound(reported=True))
        else:
            self._put(self._l1_of(url), hashes, math.inf, self._l1_bound(url, reported=True))

    def removed(self, url: str, hashes: Iterable[BlockHash], *, remote: bool) -> None:
        tier = self._l2 if remote else self._l1.get(url)
        if tier:
            for h in hashes:
                tier.pop(h, None)

    # -- what routing teaches ------------------------------------------------------------------------

    def learn(self, url: str, hashes: Sequence[BlockHash]) -> None:
        """``url`` computed or received these blocks: its L1 stores them (when it has one of known
        size), and so does the shared store when it is written through (``l2_learn``). Whole chunks
        only: LMCache does not save a prompt's last, partial chunk (``save_unfull_chunk`` off)."""
        hashes = hashes[: len(hashes) - len(hashes) % self.chunk_blocks]
        if url in self._distrusted:
            return
        until = self._clock() + self.ttl_s
        bound = self._l1_bound(url, reported=False)
        if bound:
            self._put(self._l1_of(url), hashes, until, bound)
        if self.l2_learn and self.l2_capacity:
            self._put(self._l2, hashes, until, self.l2_capacity)

    def demote(self, url: str, hashes: Sequence[BlockHash]) -> None:
        """The GPU beliefs dropped these blocks of ``url`` for room: its L1 holds them now, if it has one."""
        bound = self._l1_bound(url, reported=False)
        if bound and url not in self._distrusted:
            self._put(self._l1_of(url), hashes, self._clock() + self.ttl_s, bound)
            self.demoted += len(hashes)

    def forget_l1(self, url: str, hashes: Iterable[BlockHash] | None = None) -> None:
        """``url``'s L1 does not hold these blocks (all of them: the engine restarted or left)."""
        if hashes is None:
            self._l1.pop(url, None)
            return
        self.removed(url, hashes, remote=False)

    def forget_l2(self, hashes: Iterable[BlockHash]) -> None:
        self.removed("", hashes, remote=True)

    forget = forget_l1  # an engine restarted or left: its L1 goes, the shared store stays

    def distrust(self, url: str) -> None:
        """``url``'s counters say it does not load from the tiers: its L1 beliefs go, and neither
        tier counts for it until ``trust``."""
        self._distrusted.add(url)
        self.forget_l1(url)

    def trust(self, url: str) -> None:
        self._distrusted.discard(url)

    def distrusted(self, url: str) -> bool:
        return url in self._distrusted

    # -- lookups -------------------------------------------------------------------------------------

    def walk(self, url: str, hashes: Sequence[BlockHash], start: int) -> tuple[int, int]:
        """From block ``start`` on (past ``url``'s GPU hit): how many blocks come from its L1 and
        how many from L2, block by block, until one that no tier holds."""
        l1, l2 = self._l1.get(url), self._l2
        if (not l1 and not l2) or url in self._distrusted:
            return 0, 0
        now = self._clock()
        from_l1 = from_l2 = 0
        for h in hashes[start:]:
            if l1 is not None and l1.get(h, -1.0) >= now:
                from_l1 += 1
            elif l2.get(h, -1.0) >= now:
                from_l2 += 1
            else:
                break
        return from_l1, from_l2

    def empty(self) -> bool:
        return not self._l2 and not any(self._l1.values())

    def stats(self) -> TierStats:
        return TierStats({url: len(t) for url, t in self._l1.items() if t}, len(self._l2), self.demoted, self.evicted)

    # -- bounds --------------------------------------------------------------------------------------

    def _l1_of(self, url: str) -> OrderedDict[BlockHash, float]:
        tier = self._l1.get(url)
        if tier is None:
            tier = self._l1[url] = OrderedDict()
        return tier

    def _l1_bound(self, url: str, *, reported: bool) -> int:
        cap = self.l1_capacity(url)
        if cap:
            return cap
        return L1_SAFETY_BLOCKS if reported else 0  # learning needs a known size

    def _l2_bound(self, *, reported: bool) -> int:
        if self.l2_capacity:
            return self.l2_capacity
        return L1_SAFETY_BLOCKS if reported else 0

    def _put(self, tier: OrderedDict[BlockHash, float], hashes: Iterable[BlockHash], until: float, bound: int) -> None:
        for h in hashes:
            old = tier.pop(h, None)
            tier[h] = until if old is None else max(old, until)  # a reported entry stays reported
        over = len(tier) - bound
        if over > 0:
            for _ in range(over):
                tier.popitem(last=False)
            self.evicted += over


def tier_hold(tiers: Mapping[str, TierHold] | None, url: str, gpu_tokens: int) -> TierHold:
    """``url``'s breakdown, or its GPU hit alone when no tier breakdown was published."""
    if tiers is not None and (hold := tiers.get(url)) is not None:
        return hold
    return TierHold(gpu=gpu_tokens)


def stats_by_tier(holds: Mapping[str, TierHold]) -> Mapping[str, int]:
    """Tokens by tier over ``holds`` (metrics)."""
    return {name: sum(getattr(h, name) for h in holds.values()) for name in TIERS_NAMES}


def hold_of(ctx: RequestContext, url: str) -> TierHold:
    """What ``url`` holds of the request's prompt, by tier (its GPU hit alone without tiers)."""
    return tier_hold(ctx.data.get(TIERS), url, ctx.cached(url))


def to_compute(ctx: RequestContext, url: str) -> int:
    """Prompt tokens ``url`` must compute: neither in its GPU cache nor loadable from a tier below
    it (``ctx.uncached(url)`` when tiers are off)."""
    return ctx.prompt_tokens - hold_of(ctx, url).held


def describe(hold: TierHold) -> str:
    """``gpu=…`` alone, or with the tiers a load would come from (decision details)."""
    text = f"gpu={hold.gpu}"
    if hold.l1:
        text += f" l1={hold.l1}"
    if hold.l2:
        text += f" l2={hold.l2}"
    return text


class TierBeliefs:
    """The tier learner, a ``Lifecycle`` subscriber: a prompt an engine computed or received is in
    its L1 (and the written-through L2) from then on; an answer that served fewer cached tokens
    than the tiers were believed to hold corrects them. vLLM's ``cached_tokens`` counts the GPU's
    hits and the connectors' loads alike (vllm/v1/metrics/stats.py, ``num_local_cached_tokens +
    num_external_cached_tokens``), so it is checked against the whole believed hold."""

    def __init__(self, tiers: TierIndex) -> None:
        self.tiers = tiers
        self.corrected = 0  # tier entries dropped because an answer showed them gone

    def on_leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        hashes = ctx.block_hashes
        if not hashes or not leg.prefilled:
            return
        holds = ctx.data.get(TIERS)
        if holds is not None and leg.cached_tokens is not None and ctx.block_size:
            hold = holds.get(leg.url)
            if hold is not None and hold.gpu <= leg.cached_tokens < hold.held:
                # From the first block the engine did not load on, the tiers did not hold it.
                first, last = leg.cached_tokens // ctx.block_size, hold.held // ctx.block_size
                gone = hashes[first:last]
                self.tiers.forget_l1(leg.url, gone)
                self.tiers.forget_l2(gone)
                self.corrected += len(gone)
        self.tiers.learn(leg.url, hashes)
