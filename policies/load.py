"""Prefer lightly loaded endpoints: the gateway's own in-flight count, plus what the engine reports
(waiting and running requests, KV cache usage) when its scraped metrics are fresh.

load = in_flight + waiting_weight * waiting + running_weight * running + kv_weight * kv_usage * 10
score = 1 - load / max(load over candidates)   (all idle: every score is 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .base import EndpointView, RequestContext
from .params import non_negative


@dataclass(frozen=True)
class Load:
    inflight_weight: float = 1.0
    waiting_weight: float = 1.0
    running_weight: float = 0.25
    kv_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("inflight_weight", "waiting_weight", "running_weight", "kv_weight"):
            non_negative(name, getattr(self, name))

    def load(self, e: EndpointView) -> float:
        return (self.inflight_weight * e.in_flight
                + self.waiting_weight * (e.waiting or 0)
                + self.running_weight * (e.running or 0)
                + self.kv_weight * 10 * (e.kv_usage or 0.0))

    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        loads = [self.load(e) for e in candidates]
        top = max(loads, default=0.0)
        if top <= 0:
            return [1.0] * len(candidates)
        return [1.0 - x / top for x in loads]
