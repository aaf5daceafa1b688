"""Keep a session on one endpoint: the session header's value maps to an endpoint by consistent
hashing (adding or removing an endpoint moves only the sessions that must move), with bounded load
(Mirrokni et al.): an endpoint already carrying more than ``load_factor`` times its fair share of
in-flight requests passes the session on to the next endpoint on the ring.

Scores 1 for the session's endpoint and 0 for the others; requests without the header score 0
everywhere, so the other scorers decide."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Annotated

from cachetools import LRUCache
from pydantic import AfterValidator, Field, StrictInt, StrictStr

from .base import EndpointView, RequestContext
from .params import Number, Policy, PolicyParams


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class SessionAffinityParams(PolicyParams):
    header: Annotated[StrictStr, AfterValidator(str.lower)] = Field(  # headers arrive lower-cased
        "x-session-id", min_length=1, description="the request header naming the session"
    )
    load_factor: Number = Field(
        1.25,
        ge=1,
        description="an endpoint above this multiple of its fair share of in-flight requests passes the session on",
    )
    vnodes: StrictInt = Field(64, gt=0, description="ring points per endpoint: evens out the share each gets")


RING_CACHE_SIZE = 64


class SessionAffinity(Policy[SessionAffinityParams]):
    _rings: LRUCache[tuple[str, ...], tuple[list[int], list[str]]]

    def setup(self) -> None:
        # Rings by candidate set: sets change with health and load filters, and a few recur; building
        # one costs len(urls) x vnodes hashes, a lookup is per request.
        self._rings = LRUCache(RING_CACHE_SIZE)

    def _ring(self, urls: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(urls)
        if ring is None:
            points = sorted((_point(f"{u}#{i}"), u) for u in urls for i in range(self.params.vnodes))
            ring = ([p for p, _ in points], [u for _, u in points])
            self._rings[urls] = ring  # evicts the least recently used set past RING_CACHE_SIZE
        return ring

    def owner(self, key: str, candidates: Sequence[EndpointView]) -> EndpointView:
        by_url = {e.url: e for e in candidates}
        points, owners = self._ring(tuple(sorted(by_url)))
        total = sum(e.in_flight for e in candidates) + 1  # counting this request
        cap = math.ceil(self.params.load_factor * total / len(candidates))
        start = bisect.bisect(points, _point(key))
        seen: set[str] = set()
        for i in range(len(points)):
            url = owners[(start + i) % len(points)]
            if url in seen:
                continue
            seen.add(url)
            if by_url[url].in_flight + 1 <= cap:
                return by_url[url]
        return by_url[owners[start % len(points)]]  # unreachable: some endpoint is at or under average

    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        key = ctx.headers.get(self.params.header)
        if not key or not candidates:
            return [0.0] * len(candidates)
        chosen = self.owner(key, candidates).url
        return [1.0 if e.url == chosen else 0.0 for e in candidates]
