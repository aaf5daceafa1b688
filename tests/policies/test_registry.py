"""Policies by name: the built-in ones and third-party entry points."""

from __future__ import annotations

import pytest

from policies import registry
from policies.base import Decider, Path, PathChoice, Picker, Scorer
from policies.least_inflight import LeastInflight
from policies.prefix_affinity import PrefixAffinity

from .helpers import ctx, ep, no_prefill


def test_registry_builds_by_name_and_checks_params():
    assert registry.build("token_threshold", {"threshold": 7}, Decider).threshold == 7
    assert isinstance(registry.build("least_inflight", {}, Picker), LeastInflight)
    assert isinstance(registry.build("prefix_affinity", {}, Scorer), PrefixAffinity)
    with pytest.raises(registry.PolicyError, match="unknown policy 'nope'"):
        registry.build("nope", {}, Decider)
    with pytest.raises(registry.PolicyError, match=r"'token_threshold': treshold: unknown parameter"):
        registry.build("token_threshold", {"treshold": 7}, Decider)
    with pytest.raises(registry.PolicyError, match="is a decider, not a picker"):
        registry.build("token_threshold", {}, Picker)


def test_registry_loads_third_party_entry_points(monkeypatch):
    class Always:
        def decide(self, ctx, decode, prefill):
            return PathChoice(Path.PD, "always")

    class FakeEntryPoint:
        name = "always_pd"

        def load(self):
            return Always

    monkeypatch.setattr(
        registry, "entry_points", lambda group: [FakeEntryPoint()] if group == "pdgate.policies" else []
    )
    assert registry.build("always_pd", {}, Decider).decide(ctx(1), ep("d0"), no_prefill).path is Path.PD
