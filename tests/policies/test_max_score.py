"""The max-score picker."""

from __future__ import annotations

from policies.max_score import MaxScore

from .helpers import ctx, ep


def test_max_score_takes_the_best_and_rotates_ties():
    picker = MaxScore()
    assert picker.pick(ctx(1), [ep("a"), ep("b")], [0.2, 0.9]).url == "b"
    assert {picker.pick(ctx(1), [ep("a"), ep("b")], [0.5, 0.5]).url for _ in range(4)} == {"a", "b"}
    # among equal scores, fewer requests in flight wins
    assert picker.pick(ctx(1), [ep("a", in_flight=2), ep("b")], [0.5, 0.5]).url == "b"
