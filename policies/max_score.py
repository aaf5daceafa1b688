"""Pick the candidate with the highest weighted score; near-ties go to the one with fewer requests
in flight, then rotate (so equal endpoints share the traffic instead of the first taking it all)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pydantic import Field

from .base import EndpointView, RequestContext
from .params import Number, Policy, PolicyParams


class MaxScoreParams(PolicyParams):
    tie_margin: Number = Field(1e-6, ge=0, description="scores closer than this count as equal")


class MaxScore(Policy[MaxScoreParams]):
    _turns: defaultdict[str, int]

    def setup(self) -> None:
        self._turns = defaultdict(int)

    def pick(self, ctx: RequestContext, candidates: Sequence[EndpointView], scores: Sequence[float]) -> EndpointView:
        if not candidates:
            raise ValueError("no candidates")
        best = max(scores) if scores else 0.0
        margin = self.params.tie_margin
        top = [e for e, s in zip(candidates, scores or [0.0] * len(candidates), strict=True) if s >= best - margin]
        if len(top) == 1:
            return top[0]
        pool = top[0].pool
        start = self._turns[pool] % len(top)
        self._turns[pool] += 1
        return min([*top[start:], *top[:start]], key=lambda e: e.in_flight)
