"""Keep cache affinity from piling a burst onto the engines that hold a shared prefix.

A candidate stays while its load is at most ``load_factor`` x the candidates' mean load + ``slack``
(consistent hashing with bounded loads, applied to prefix affinity): past that bound the scorers
choose among the others, so a hot prefix spreads once its engines are busier than the rest, and
costs a prefill elsewhere instead of a queue.

    load = in_flight + waiting      (the engine's waiting count only from a fresh scrape)

The least loaded candidate is never above the mean, so the filter never empties the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from .base import EndpointView, RequestContext
from .params import Number, Policy, PolicyParams


class BoundedLoadParams(PolicyParams):
    load_factor: Number = Field(
        1.25,
        ge=1,
        description="bound as a multiple of the candidates' mean load "
        "(the same name and meaning as session_affinity's)",
    )
    slack: Number = Field(2.0, ge=0, description="requests allowed above that bound")


class BoundedLoad(Policy[BoundedLoadParams]):
    @staticmethod
    def load(e: EndpointView) -> float:
        return e.in_flight + (e.waiting or 0)

    def filter(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if len(candidates) < 2:
            return candidates
        loads = [self.load(e) for e in candidates]
        bound = self.params.load_factor * sum(loads) / len(loads) + self.params.slack
        return [e for e, x in zip(candidates, loads, strict=True) if x <= bound]
