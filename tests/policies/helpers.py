from __future__ import annotations

from policies.base import EndpointView, RequestContext


def ep(url: str, pool: str = "decode", in_flight: int = 0, **kw) -> EndpointView:
    return EndpointView(url, pool, True, in_flight, **kw)


def ctx(tokens: int, **kw) -> RequestContext:
    return RequestContext(model="m", request_id="r", token_ids=list(range(tokens)), **kw)
