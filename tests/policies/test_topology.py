"""The topology scorer: the prefill engines nearest the decode engine in the network."""

from __future__ import annotations

from policies.topology import TopologyAffinity

from .helpers import at, ctx, paired


def test_topology_scores_shared_levels_from_the_broadest_down():
    d = at("d", "decode", "a", "spine-1")
    cands = [
        at("same", "prefill", "a", "spine-1"),
        at("zone", "prefill", "a", "spine-2"),
        at("far", "prefill", "b", "spine-1"),
        at("unknown", "prefill"),
    ]
    # a spine name in another zone counts nothing
    assert TopologyAffinity().score(paired(d), cands) == [1.0, 0.5, 0.0, 0.0]
    # decode spine unknown: only the zone can count
    assert TopologyAffinity().score(paired(at("d", "decode", "a")), cands) == [0.5, 0.5, 0.0, 0.0]
    assert TopologyAffinity().score(ctx(10), cands) == [0.0] * 4
