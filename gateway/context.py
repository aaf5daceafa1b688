"""The two things a request is served with: the ``Runtime`` of the config version it started under,
and the ``Services`` that live with the process.

A reload builds a new ``Runtime`` (``Runtime.build``) from the new config and the same ``Services``,
and swaps it whole between requests. ``Services`` is built once by ``http/assembly.py``; what a
config changes in it (queue bounds, pool membership, feeds) is reconfigured in place by the
lifecycle and ``http/reconfigure.py``, never replaced. Parts a unit test of the request path does
not need (the control-plane session, discovery, the worker bus, ...) may be left out there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from gateway.adapters.catalogue import Adapter, Catalogue
from gateway.adapters.loader import AdapterLoader
from gateway.cluster.redis_state import RedisState
from gateway.cluster.workerbus import WorkerBus
from gateway.config import FairnessConfig, GatewayConfig
from gateway.config.reload import ConfigWatcher
from gateway.engines.discovery import Discovery
from gateway.engines.legs import KVReleaser
from gateway.engines.modelcheck import ServedModels
from gateway.engines.pools import HealthChecker, Pools
from gateway.engines.subscriptions import Subscriptions
from gateway.engines.transport import EngineTransport
from gateway.engines.upstream import Upstream
from gateway.fairness.admission import Gate, LoopLag
from gateway.fairness.fairqueue import FairQueue, PoolQueues
from gateway.fairness.tenants import Labels, Tenancy, Usage, label_secret
from gateway.ops.live_planner import Demand
from gateway.ops.metrics import BeliefAudit, GatewayMetrics
from gateway.ops.requestlog import AccessLog
from gateway.ops.tracing import Tracing
from gateway.request.router import Router
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers
from policies.beliefs.estimates import EngineEstimates
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import PrefixBeliefs
from policies.beliefs.tier_audit import TierCounterCheck
from policies.beliefs.tiers import TierBeliefs
from policies.hooks import Hooks, policy_hooks


@dataclass(frozen=True)
class Learners:
    """The gateway's own lifecycle subscribers; they outlive config versions with what they learned."""

    beliefs: PrefixBeliefs  # what each engine holds in its prefix cache
    estimates: EngineEstimates  # prefill speeds and P/D hand-over times
    audit: BeliefAudit  # how far routing's beliefs are from what the engines report
    demand: Demand  # what the traffic asks of the engines (the live planner's input)
    tiers: TierBeliefs | None = None  # what each engine's CPU tier and the shared store hold
    counters: TierCounterCheck | None = None  # the engines' hit counters against the tier beliefs

    def subscribers(self) -> list[tuple[str, object]]:
        subs: list[tuple[str, object]] = [
            ("prefix_beliefs", self.beliefs),
            ("engine_estimates", self.estimates),
            ("belief_audit", self.audit),
            ("demand", self.demand),
        ]
        if self.tiers is not None:
            subs.insert(1, ("tier_beliefs", self.tiers))
        if self.counters is not None:
            subs.append(("tier_counter_check", self.counters))
        return subs

    def forget(self, url: str) -> None:
        """``url`` left the configuration (or restarted): its L1 goes with it, the shared L2 stays."""
        self.beliefs.index.forget(url)
        self.beliefs.in_flight.forget(url)
        self.estimates.forget(url)
        if self.tiers is not None:
            self.tiers.tiers.forget(url)
        if self.counters is not None:
            self.counters.forget(url)


@dataclass(frozen=True)
class Services:
    """What lives with the process: the engines and what is believed about them, admission and
    fair queueing, telemetry, and the background parts the status routes report on."""

    pools: Pools
    metrics: GatewayMetrics
    tracing: Tracing
    access_log: AccessLog
    gate: Gate  # admission: requests in flight through this gateway (a SharedGate with workers)
    releaser: KVReleaser  # frees KV a departed client's prefill left behind
    lag: LoopLag = field(default_factory=LoopLag)  # how late the event loop runs (admission sheds past a bound)
    usage: Usage = field(default_factory=Usage)  # each tenant's use of each pool (fair queueing's order)
    tenant_labels: Labels = field(default_factory=lambda: Labels(20))
    index: PrefixIndex = field(default_factory=PrefixIndex)  # which engine holds which prompt blocks
    learners: Learners | None = None  # what requests teach (None: a test that learns nothing)
    engines: EngineTransport | None = None  # the engine legs' connections: warm keep-alives survive reloads
    session: aiohttp.ClientSession | None = None  # control plane: health checks, metrics scrapes, model lists
    subs: Subscriptions | None = None  # the KV event feeds
    models: ServedModels | None = None  # what each engine serves, against the configured model names
    loader: AdapterLoader | None = None  # loads LoRA adapters on the engines routing picks (lora.dynamic_loading)
    health: HealthChecker | None = None  # the engines' health checker (/ready asks it for a fresh look)
    shared: RedisState | None = None  # beliefs shared across replicas, when configured
    discovery: Discovery | None = None  # engines found through the Kubernetes API
    bus: WorkerBus | None = None  # the other worker processes of this gateway (server.workers > 1)
    watcher: ConfigWatcher | None = None  # the config file's watcher, when the config comes from a file
    queues: PoolQueues = field(init=False)  # who waits for room in the engine pools, ordered by ``usage``

    def __post_init__(self) -> None:
        object.__setattr__(self, "queues", PoolQueues(self.usage))  # (frozen: set once, here)

    def queue(self, pool: str, model: str) -> FairQueue:
        return self.queues.get(pool, model)

    def configure(self, f: FairnessConfig, tenants: list[str]) -> None:
        """A config (re)load: every queue takes the new order and bounds at once."""
        self.usage.configure(f.half_life_s, f.max_tenants)
        self.tenant_labels.configure(f.metrics_top_tenants, tenants)
        self.gate.queue.configure(f.enabled, f.max_queued, f.max_queued_per_tenant)
        self.queues.configure(f)

    def forget(self, url: str) -> None:
        """``url`` left the configuration: nothing learned about it holds."""
        if self.learners is not None:
            self.learners.forget(url)
        if self.loader is not None:
            self.loader.forget(url)


@dataclass(frozen=True)
class Runtime:
    """Everything one config version decides; a reload swaps it whole, between requests (a request
    keeps the runtime it started with)."""

    cfg: GatewayConfig
    version: str
    router: Router
    upstream: Upstream
    tokenizers: Tokenizers
    hooks: Hooks  # the learners' and the pipeline's lifecycle hooks
    api_keys: tuple[bytes, ...] = ()  # empty: no key needed
    admin_token: str | None = None  # admin and debug endpoints are off without one
    tenancy: Tenancy = field(default_factory=lambda: Tenancy(FairnessConfig()))  # keys -> tenants, classes
    adapters: Catalogue | None = None  # LoRA adapter names: configured, and discovered on the engines

    def served(self, model: str) -> tuple[ModelTokenizer, Adapter | None] | None:
        """The tokenizer (and, for a LoRA adapter, the adapter) of the ``model`` a request names;
        None: nothing served by that name. An adapter uses its base model's tokenizer and template."""
        tok = self.tokenizers.get(model)
        if tok is not None:
            return tok, None
        adapter = self.adapters.resolve(model) if self.adapters is not None else None
        if adapter is None or (base := self.tokenizers.get(adapter.base)) is None:
            return None
        return base, adapter

    @classmethod
    def build(
        cls, cfg: GatewayConfig, version: str, services: Services, tokenizers: Tokenizers, admin: str | None
    ) -> Runtime:
        """The runtime ``cfg`` makes of the process's ``services`` (which must have been assembled
        whole: learners and engine connections)."""
        s, learners, engines = services, services.learners, services.engines
        if learners is None or engines is None:
            raise ValueError("Runtime.build needs assembled services (learners and engine connections)")
        tiers = learners.tiers.tiers if learners.tiers is not None else None
        router = Router(
            cfg.routing, s.pools, s.index, s.shared, learners.beliefs.in_flight, learners.estimates, tiers=tiers
        )
        hooks = Hooks([*learners.subscribers(), *policy_hooks(router.pipeline.members())], s.metrics.hook_failed)
        keys = cfg.key_entries()
        return cls(
            cfg,
            version,
            router,
            Upstream(engines, cfg.timeouts),
            tokenizers,
            hooks,
            tuple(k.key.encode() for k in keys),
            admin,
            Tenancy(cfg.fairness, keys, label_secret(cfg.admin)),
            Catalogue(cfg, s.pools),
        )
