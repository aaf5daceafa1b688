"""The KV event feeds: one subscriber per endpoint whose config names a publisher, kept in step
with the config in force (a reload or a discovery change starts, stops or replaces them)."""

from __future__ import annotations

import asyncio

from gateway.config import GatewayConfig
from gateway.engines.kvevents import KVEventSubscriber
from gateway.engines.kvwire import FeedLimits
from policies.beliefs.blockhash import DEFAULT_BLOCK_SIZE, HashSpec
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.tiers import TierIndex


class Subscriptions:
    """One KV-event subscriber per endpoint whose config names a publisher."""

    def __init__(self, index: PrefixIndex, tiers: TierIndex | None = None) -> None:
        self._index = index
        self._tiers = tiers  # where a tier's events go when tiers are on (routing.tiers.enabled)
        # (url, kv_events, kv_events_replay, kv_events_topic, hash spec, bounds): a change to any starts a new one
        self._subs: dict[
            tuple[str, str | None, str | None, str, HashSpec, FeedLimits, int, TierIndex | None], KVEventSubscriber
        ] = {}
        self._lock = asyncio.Lock()  # a reload and a discovery change may update at once

    async def update(self, cfg: GatewayConfig) -> None:
        async with self._lock:
            await self._update(cfg)

    async def _update(self, cfg: GatewayConfig) -> None:
        p = cfg.routing.prefix
        spec = HashSpec(block_size=p.block_size or DEFAULT_BLOCK_SIZE, algo=p.hash_algo, seed=p.hash_seed)
        limits = FeedLimits(p.max_event_message_bytes, p.max_event_batch_blocks)
        self._index.max_precise_per_url = p.max_event_blocks  # applies from the next stored batch
        tiers = self._tiers if cfg.routing.tiers.enabled else None
        wanted = {
            (e.url, e.kv_events, e.kv_events_replay, e.kv_events_topic, spec, limits, p.max_event_blocks, tiers): e
            for pool in (cfg.pools.prefill, cfg.pools.decode)
            for e in pool.endpoints
            if e.kv_events and p.enabled
        }
        for key in [k for k in self._subs if k not in wanted]:
            await self._subs.pop(key).stop()
        for key in wanted.keys() - self._subs.keys():
            url, addr, replay, topic, _, _, max_blocks, _ = key
            sub = KVEventSubscriber(
                url,
                addr,
                index=self._index,
                replay_endpoint=replay,
                topic=topic,
                spec=spec,
                limits=limits,
                max_translations=max_blocks,
                tiers=tiers,
            )
            await sub.start()
            self._subs[key] = sub

    def all(self) -> list[KVEventSubscriber]:
        return list(self._subs.values())

    async def close(self) -> None:
        await asyncio.gather(*(sub.stop() for sub in self._subs.values()))  # each bounded; all at once
        self._subs.clear()
