"""Pick the endpoint with the fewest requests the gateway has in flight on it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from .base import EndpointView, RequestContext


@dataclass
class LeastInflight:
    # Rotating the start of the scan spreads ties instead of piling them on the first endpoint.
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)

    def pick(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> EndpointView:
        if not candidates:
            raise ValueError("no candidates")
        start = next(self._turn) % len(candidates)
        rotated = list(candidates[start:]) + list(candidates[:start])
        return min(rotated, key=lambda e: e.in_flight)
