"""Keep the KV transfer inside one availability zone: a prefill engine serves only a decode engine
in its zone.

On EKS the decode engine pulls the prompt's KV from the prefill engine over EFA, and EFA traffic
does not cross availability zones: a cross-zone pairing falls back to TCP at best (slower than
prefilling locally) or fails the pull. The zone of each engine comes from its EndpointSlice
(``zone``) or its static ``topology``.

In the prefill pipeline it keeps the candidates in the decode engine's zone. An engine whose zone
is not known is kept (nothing says it is elsewhere), and so is every candidate when the decode
engine's zone is not known. With ``strict`` (the default), when no candidate is in the zone the
request takes the direct path (reason ``no_prefill_in_zone``) instead of a cross-zone pairing; with
``strict: false`` the filter is soft like the others (skipped when it would keep none).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from .base import ZONE, EndpointView, NoPairing, RequestContext
from .params import Policy, PolicyParams


class SameZoneParams(PolicyParams):
    key: str = Field(ZONE, min_length=1, description="the topology label that names the zone")
    strict: bool = Field(True, description="no candidate in the zone: go direct rather than pair across zones")


class SameZone(Policy[SameZoneParams]):
    def filter(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[EndpointView]:
        key = self.params.key
        if ctx.paired is None or (zone := ctx.paired.where(key)) is None:
            return candidates
        kept = [e for e in candidates if e.where(key) in (zone, None)]
        if not kept and self.params.strict:
            raise NoPairing("no_prefill_in_zone", f"no prefill engine in {key}={zone}")
        return kept
