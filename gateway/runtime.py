"""What a request is served with: the config version it started under, and the long-lived services."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.hooks import Hooks

from .admission import Gate, LoopLag
from .config import FairnessConfig, GatewayConfig
from .fairqueue import FairQueue
from .legs import KVReleaser
from .metrics import GatewayMetrics
from .pools import Pools
from .requestlog import AccessLog
from .router import Router
from .tenants import Labels, Tenancy, Usage
from .tokenizer import Tokenizers
from .tracing import Tracing
from .upstream import Upstream


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


@dataclass(frozen=True)
class Services:
    """What outlives config versions and every request uses."""

    pools: Pools
    metrics: GatewayMetrics
    tracing: Tracing
    access_log: AccessLog
    gate: Gate  # admission: requests in flight through this gateway (a SharedGate with workers)
    releaser: KVReleaser  # frees KV a departed client's prefill left behind
    lag: LoopLag = field(default_factory=LoopLag)  # how late the event loop runs (admission sheds past a bound)
    usage: Usage = field(default_factory=Usage)  # each tenant's use of each pool (fair queueing's order)
    queues: dict[tuple[str, str], FairQueue] = field(default_factory=dict)  # (pool, model) -> who waits for room
    tenant_labels: Labels = field(default_factory=lambda: Labels(20))
    fairness: list[FairnessConfig] = field(default_factory=lambda: [FairnessConfig()])  # the one in force

    def queue(self, pool: str, model: str) -> FairQueue:
        """Requests of ``model`` waiting for room in ``pool`` ("prefill", "decode"); one queue per
        model, as room on one model's engines says nothing about another's."""
        q = self.queues.get((pool, model))
        if q is None:
            f = self.fairness[0]
            q = self.queues[(pool, model)] = FairQueue(pool, self.usage, fair=f.enabled, max_queued=f.max_queued,
                                                       max_per_tenant=f.max_queued_per_tenant)
        return q

    def released(self, pool: str) -> None:
        """A slot in ``pool`` is free: the best waiter of each model's queue looks (one per model)."""
        for (p, _), q in self.queues.items():
            if p == pool and q:
                q.wake()

    def configure(self, f: FairnessConfig, tenants: list[str]) -> None:
        """A config (re)load: every queue takes the new order and bounds at once."""
        self.fairness[0] = f
        self.usage.configure(f.half_life_s, f.max_tenants)
        self.tenant_labels.configure(f.metrics_top_tenants, tenants)
        for q in [*self.queues.values(), self.gate.queue]:
            q.configure(f.enabled, f.max_queued, f.max_queued_per_tenant)
