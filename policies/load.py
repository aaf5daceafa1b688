"""Prefer lightly loaded endpoints: the gateway's own in-flight count, plus what the engine reports
(waiting and running requests, KV cache usage) when its scraped metrics are fresh.

load = in_flight + waiting_weight * waiting + running_weight * running + kv_weight * kv_usage * 10
score = 1 - load / max(load over candidates, scale_floor)   (all idle: every score is 1)

The floor keeps a small difference small: against only the busiest candidate's load, one running
request (0.25) against none took a whole point, and outweighed a decode engine's L1-held prefix or
the only engine holding a request's LoRA adapter (a load it then had to make). Below the floor a
load costs its share of the floor; under real load the busiest candidate scales it, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from .base import EndpointView, RequestContext
from .params import Number, Policy, PolicyParams


class LoadParams(PolicyParams):
    inflight_weight: Number = Field(1.0, ge=0, description="per request the gateway has in flight there")
    waiting_weight: Number = Field(1.0, ge=0, description="per request the engine reports waiting")
    running_weight: Number = Field(0.25, ge=0, description="per request the engine reports running")
    kv_weight: Number = Field(1.0, ge=0, description="per 10% of KV cache in use")
    scale_floor: Number = Field(
        4.0, gt=0, description="loads are scored against the busiest candidate's, but never a smaller one than this"
    )


class Load(Policy[LoadParams]):
    def load(self, e: EndpointView) -> float:
        p = self.params
        return (
            p.inflight_weight * e.in_flight
            + p.waiting_weight * (e.waiting or 0)
            + p.running_weight * (e.running or 0)
            + p.kv_weight * 10 * (e.kv_usage or 0.0)
        )

    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        loads = [self.load(e) for e in candidates]
        top = max(max(loads, default=0.0), float(self.params.scale_floor))
        return [1.0 - x / top for x in loads]
