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
from dataclasses import dataclass, field

from .base import EndpointView, RequestContext
from .params import positive, positive_int


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass
class SessionAffinity:
    header: str = "x-session-id"
    load_factor: float = 1.25
    vnodes: int = 64  # ring points per endpoint: evens out the share each endpoint gets

    _rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.header, str) or not self.header:
            raise ValueError("header must be a header name")
        self.header = self.header.lower()
        positive("load_factor", self.load_factor)
        if self.load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        positive_int("vnodes", self.vnodes)

    def _ring(self, urls: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(urls)
        if ring is None:
            points = sorted((_point(f"{u}#{i}"), u) for u in urls for i in range(self.vnodes))
            ring = ([p for p, _ in points], [u for _, u in points])
            if len(self._rings) > 64:  # candidate sets change with health; keep only recent ones
                self._rings.clear()
            self._rings[urls] = ring
        return ring

    def owner(self, key: str, candidates: Sequence[EndpointView]) -> EndpointView:
        by_url = {e.url: e for e in candidates}
        points, owners = self._ring(tuple(sorted(by_url)))
        total = sum(e.in_flight for e in candidates) + 1  # counting this request
        cap = math.ceil(self.load_factor * total / len(candidates))
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
        key = ctx.headers.get(self.header)
        if not key or not candidates:
            return [0.0] * len(candidates)
        chosen = self.owner(key, candidates).url
        return [1.0 if e.url == chosen else 0.0 for e in candidates]
