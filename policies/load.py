"""Prefer lightly loaded endpoints: the gateway's own in-flight count, plus what the engine reports
(waiting and running requests, KV cache usage) when its scraped metrics are fresh.

load = in_flight + waiting_weight * waiting + running_weight * running + kv_weight * kv_usage * 10
score = 1 - load / max(load over candidates)   (all idle: every score is 1)
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
        top = max(loads, default=0.0)
        if top <= 0:
            return [1.0] * len(candidates)
        return [1.0 - x / top for x in loads]
