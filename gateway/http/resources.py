"""What outlives config versions (connections, endpoint state, the prefix index, event feeds,
the learners), and the ``Runtime`` one config version makes of them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from gateway.cluster.redis_state import RedisState
from gateway.config import GatewayConfig
from gateway.context import Runtime
from gateway.engines.discovery import Discovery
from gateway.engines.kvevents import KVEventSubscriber
from gateway.engines.kvwire import FeedLimits
from gateway.engines.modelcheck import ServedModels
from gateway.engines.pools import Pools
from gateway.engines.transport import EngineTransport
from gateway.engines.upstream import Upstream
from gateway.fairness.tenants import Tenancy, label_secret
from gateway.ops.live_planner import Demand
from gateway.ops.metrics import BeliefAudit, GatewayMetrics
from gateway.request.router import DEFAULT_BLOCK_SIZE, Router
from gateway.tokenization.tokenizer import Tokenizers
from policies.beliefs.blockhash import HashSpec
from policies.beliefs.estimates import EngineEstimates
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import PrefixBeliefs
from policies.hooks import Hooks, policy_hooks


class Subscriptions:
    """One KV-event subscriber per endpoint whose config names a publisher."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        # (url, kv_events, kv_events_replay, kv_events_topic, hash spec, bounds): a change to any starts a new one
        self._subs: dict[tuple[str, str | None, str | None, str, HashSpec, FeedLimits, int], KVEventSubscriber] = {}
        self._lock = asyncio.Lock()  # a reload and a discovery change may update at once

    async def update(self, cfg: GatewayConfig) -> None:
        async with self._lock:
            await self._update(cfg)

    async def _update(self, cfg: GatewayConfig) -> None:
        p = cfg.routing.prefix
        spec = HashSpec(block_size=p.block_size or DEFAULT_BLOCK_SIZE, algo=p.hash_algo, seed=p.hash_seed)
        limits = FeedLimits(p.max_event_message_bytes, p.max_event_batch_blocks)
        self._index.max_precise_per_url = p.max_event_blocks  # applies from the next stored batch
        wanted = {
            (e.url, e.kv_events, e.kv_events_replay, e.kv_events_topic, spec, limits, p.max_event_blocks): e
            for pool in (cfg.pools.prefill, cfg.pools.decode)
            for e in pool.endpoints
            if e.kv_events and p.enabled
        }
        for key in [k for k in self._subs if k not in wanted]:
            await self._subs.pop(key).stop()
        for key in wanted.keys() - self._subs.keys():
            url, addr, replay, topic, _, _, max_blocks = key
            sub = KVEventSubscriber(
                url,
                addr,
                index=self._index,
                replay_endpoint=replay,
                topic=topic,
                spec=spec,
                limits=limits,
                max_translations=max_blocks,
            )
            await sub.start()
            self._subs[key] = sub

    def all(self) -> list[KVEventSubscriber]:
        return list(self._subs.values())

    async def close(self) -> None:
        await asyncio.gather(*(sub.stop() for sub in self._subs.values()))  # each bounded; all at once
        self._subs.clear()


@dataclass(frozen=True)
class Learners:
    """The gateway's own lifecycle subscribers; they outlive config versions with what they learned."""

    beliefs: PrefixBeliefs  # what each engine holds in its prefix cache
    estimates: EngineEstimates  # prefill speeds and P/D hand-over times
    audit: BeliefAudit  # how far routing's beliefs are from what the engines report
    demand: Demand  # what the traffic asks of the engines (the live planner's input)

    def subscribers(self) -> list[tuple[str, object]]:
        return [
            ("prefix_beliefs", self.beliefs),
            ("engine_estimates", self.estimates),
            ("belief_audit", self.audit),
            ("demand", self.demand),
        ]

    def forget(self, url: str) -> None:
        """``url`` left the configuration."""
        self.beliefs.index.forget(url)
        self.beliefs.in_flight.forget(url)
        self.estimates.forget(url)


@dataclass(frozen=True)
class Resources:
    """What outlives config versions: connections, endpoint state, the prefix index, event feeds."""

    session: aiohttp.ClientSession  # control plane: health checks, metrics scrapes, model lists
    engines: EngineTransport  # the engine legs: warm keep-alive connections survive reloads
    pools: Pools
    index: PrefixIndex
    shared: RedisState | None
    subs: Subscriptions
    discovery: Discovery | None  # engines found through the Kubernetes API
    models: ServedModels
    learners: Learners
    metrics: GatewayMetrics


def runtime_for(cfg: GatewayConfig, version: str, res: Resources, tokenizers: Tokenizers, admin: str | None) -> Runtime:
    learners = res.learners
    router = Router(cfg.routing, res.pools, res.index, res.shared, learners.beliefs.in_flight, learners.estimates)
    hooks = Hooks([*learners.subscribers(), *policy_hooks(router.pipeline.members())], res.metrics.hook_failed)
    keys = cfg.key_entries()
    return Runtime(
        cfg,
        version,
        router,
        Upstream(res.engines, cfg.timeouts),
        tokenizers,
        hooks,
        tuple(k.key.encode() for k in keys),
        admin,
        Tenancy(cfg.fairness, keys, label_secret(cfg.admin)),
    )
