"""What a request is served with: the config version it started under, and the long-lived services."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.config import FairnessConfig, GatewayConfig
from gateway.engines.legs import KVReleaser
from gateway.engines.pools import Pools
from gateway.engines.upstream import Upstream
from gateway.fairness.admission import Gate, LoopLag
from gateway.fairness.fairqueue import FairQueue, PoolQueues
from gateway.fairness.tenants import Labels, Tenancy, Usage
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.requestlog import AccessLog
from gateway.ops.tracing import Tracing
from gateway.request.router import Router
from gateway.tokenization.tokenizer import Tokenizers
from policies.hooks import Hooks


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
    tenant_labels: Labels = field(default_factory=lambda: Labels(20))
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
