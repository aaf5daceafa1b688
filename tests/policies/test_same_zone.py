"""The same-zone filter: a prefill engine serves only a decode engine in its zone."""

from __future__ import annotations

import pytest

from policies.base import NoPairing
from policies.same_zone import SameZone

from .helpers import at, ctx, ep, paired


def test_same_zone_keeps_the_decode_engines_zone_and_engines_of_unknown_zone():
    cands = [at("pa", "prefill", "a"), at("pb", "prefill", "b"), at("p?", "prefill")]
    kept = SameZone().filter(paired(at("d", "decode", "a")), cands)
    assert [e.url for e in kept] == ["pa", "p?"]


def test_same_zone_judges_nothing_without_the_decode_engines_zone():
    cands = [at("pa", "prefill", "a"), at("pb", "prefill", "b")]
    assert SameZone().filter(paired(at("d", "decode")), cands) == cands
    assert SameZone().filter(ctx(10), cands) == cands  # not pairing (the decode pool choosing)


def test_strict_same_zone_refuses_a_cross_zone_pairing_and_soft_keeps_none():
    cands = [at("pb", "prefill", "b")]
    with pytest.raises(NoPairing) as err:
        SameZone().filter(paired(at("d", "decode", "a")), cands)
    assert err.value.reason == "no_prefill_in_zone"
    assert SameZone(strict=False).filter(paired(at("d", "decode", "a")), cands) == []


def test_same_zone_reads_the_configured_key():
    cands = [ep("p1", "prefill", topology=(("rack", "r1"),)), ep("p2", "prefill", topology=(("rack", "r2"),))]
    kept = SameZone(key="rack").filter(paired(ep("d", topology=(("rack", "r2"),))), cands)
    assert [e.url for e in kept] == ["p2"]
