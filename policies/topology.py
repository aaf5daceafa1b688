"""Prefer the prefill engine closest to the decode engine in the network.

Inside one availability zone, GPU nodes under the same network spine (EC2 instance topology: the
``topology.k8s.aws/network-node-layer-N`` Node labels) move the KV cache with fewer switch hops than
nodes under another spine. ``levels`` lists topology labels from the broadest to the narrowest (e.g.
the zone, then the layer-3 network node); a candidate scores the share of them it shares with the
decode engine, counted from the broadest down and stopping at the first difference (a shared spine
name in another zone means nothing). Where the decode engine's value of a key is not known, that
key and the narrower ones do not count for anyone.

Topology labels come from discovery (``node_labels``; the slice's zone always) or a static
endpoint's ``topology``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from .base import ZONE, EndpointView, RequestContext
from .params import Policy, PolicyParams


class TopologyParams(PolicyParams):
    levels: tuple[str, ...] = Field(
        (ZONE, "topology.k8s.aws/network-node-layer-3"),
        min_length=1,
        max_length=8,
        description="topology labels, broadest first",
    )


class TopologyAffinity(Policy[TopologyParams]):
    type_name = "topology"

    def score(self, ctx: RequestContext, candidates: Sequence[EndpointView]) -> Sequence[float]:
        if ctx.paired is None:
            return [0.0] * len(candidates)
        levels = self.params.levels
        known: list[tuple[str, str]] = []
        for key in levels:
            if (value := ctx.paired.where(key)) is None:
                break
            known.append((key, value))
        if not known:
            return [0.0] * len(candidates)
        scores = []
        for e in candidates:
            shared = 0
            for key, value in known:
                if e.where(key) != value:
                    break
                shared += 1
            scores.append(shared / len(levels))
        return scores
