"""The least-in-flight picker."""

from __future__ import annotations

import pytest

from policies import registry
from policies.base import Picker
from policies.least_inflight import LeastInflight

from .helpers import ctx, ep


def test_least_inflight_prefers_idle_and_spreads_ties():
    picker = LeastInflight()
    assert picker.pick(ctx(1), [ep("a", in_flight=3), ep("b", in_flight=1)], [0, 0]).url == "b"
    picks = {picker.pick(ctx(1), [ep("a"), ep("b")], [0, 0]).url for _ in range(4)}
    assert picks == {"a", "b"}


def test_least_inflight_takes_no_config():
    with pytest.raises(registry.PolicyError):
        registry.build("least_inflight", {"_turns": {}}, Picker)
