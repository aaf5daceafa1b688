from __future__ import annotations

from dataclasses import replace

from policies.base import ZONE, EndpointView, RequestContext

SPINE = "topology.k8s.aws/network-node-layer-3"


def ep(url: str, pool: str = "decode", in_flight: int = 0, healthy: bool = True, **kw) -> EndpointView:
    return EndpointView(url, pool, healthy, in_flight, **kw)


def ctx(tokens: int, **kw) -> RequestContext:
    return RequestContext(model="m", request_id="r", token_ids=list(range(tokens)), **kw)


def no_prefill() -> EndpointView | None:
    return None


def at(url: str, pool: str, zone: str | None = None, spine: str | None = None, **kw) -> EndpointView:
    """An endpoint in ``zone`` under network ``spine`` (None: not known)."""
    where = tuple(sorted((k, v) for k, v in ((ZONE, zone), (SPINE, spine)) if v is not None))
    return ep(url, pool, topology=where, **kw)


def paired(decode: EndpointView, tokens: int = 10) -> RequestContext:
    """A request while the prefill pool chooses for ``decode``."""
    return replace(ctx(tokens), paired=decode)
