"""Pick the endpoint with the fewest requests the gateway has in flight on it (scores ignored)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .base import EndpointView, RequestContext
from .params import NoParams, Policy


class LeastInflight(Policy[NoParams]):
    _turns: defaultdict[str, int]

    def setup(self) -> None:
        # Ties rotate, per pool: one shared counter would alternate between pools and pin every P/D
        # request to the same prefill/decode pair.
        self._turns = defaultdict(int)

    def pick(self, ctx: RequestContext, candidates: Sequence[EndpointView], scores: Sequence[float]) -> EndpointView:
        if not candidates:
            raise ValueError("no candidates")
        pool = candidates[0].pool
        start = self._turns[pool] % len(candidates)
        self._turns[pool] += 1
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda e: e.in_flight)
