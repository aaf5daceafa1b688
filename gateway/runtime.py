"""What a request is served with: the config version it started under, and the long-lived services."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.hooks import Hooks

from .admission import Gate, LoopLag
from .config import GatewayConfig
from .legs import KVReleaser
from .metrics import GatewayMetrics
from .pools import Pools
from .requestlog import AccessLog
from .router import Router
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
