"""The engines' own hit counters against the tier beliefs: measured, and an engine that does not
load what it was believed to hold has its tiers distrusted until its counters show tier loads."""

from __future__ import annotations

from policies.base import LegOutcome, LegReport, Path
from policies.beliefs.tier_audit import TierCounterCheck
from policies.beliefs.tiers import TIERS, TierHold, TierIndex

from .helpers import ctx

A = "http://a:8000"
HASHES = list(range(1, 11))


def _leg(url: str = A, *, leg: str = "decode", path: Path = Path.DIRECT) -> LegReport:
    return LegReport(leg=leg, url=url, outcome=LegOutcome.OK, path=path, seconds=0.1)  # type: ignore[arg-type]


def _served(check: TierCounterCheck, hold: TierHold, **kw) -> None:
    c = ctx(hold.held + 16, block_size=16, block_hashes=HASHES)
    c.data.put(TIERS, {A: hold})
    check.on_leg_done(c, _leg(**kw))


def _setup(**kw) -> tuple[TierIndex, TierCounterCheck]:
    tiers = TierIndex(l1_capacity=lambda url: 100)
    tiers.stored(A, HASHES, remote=False)
    check = TierCounterCheck(tiers, min_tokens=1000, **kw)
    check.on_counters(A, {"device": 0.0, "external_unspecified": 0.0, "p2p": 0.0})  # the baseline
    return tiers, check


def test_an_engine_whose_counters_show_no_tier_loads_has_its_tiers_distrusted() -> None:
    tiers, check = _setup()
    for _ in range(4):
        _served(check, TierHold(gpu=0, l1=320))  # 1,280 tokens believed loaded from A's L1
    check.on_counters(A, {"device": 0.0, "external_unspecified": 0.0, "p2p": 5000.0})  # p2p is a hand-over
    assert tiers.distrusted(A) and tiers.walk(A, HASHES, 0) == (0, 0)  # its L1 beliefs are gone
    state = check.state()[A]
    assert state.distrusted and state.ratio["below"] == 0.0 and check.distrusts == 1
    tiers.learn(A, HASHES)  # nothing is learned into a distrusted engine's L1 either
    assert tiers.walk(A, HASHES, 0) == (0, 0)


def test_counters_that_confirm_the_beliefs_leave_them_trusted_and_say_how_far() -> None:
    tiers, check = _setup()
    for _ in range(4):
        _served(check, TierHold(gpu=160, l1=320))
    check.on_counters(A, {"device": 640.0, "external_unspecified": 1000.0, "p2p": 0.0})
    assert not tiers.distrusted(A) and tiers.walk(A, HASHES, 0) == (10, 0)
    assert check.state()[A].ratio == {"below": 1000 / 1280}  # the GPU's 640 is under min_tokens: not judged


def test_a_window_is_judged_only_once_enough_was_believed() -> None:
    tiers, check = _setup()
    _served(check, TierHold(gpu=0, l1=320))
    check.on_counters(A, {"device": 0.0, "external_unspecified": 0.0})
    assert not tiers.distrusted(A) and check.state()[A].ratio == {}


def test_a_distrusted_engine_is_trusted_again_once_its_counters_show_tier_loads() -> None:
    tiers, check = _setup()
    for _ in range(4):
        _served(check, TierHold(l1=320))
    check.on_counters(A, {"external_unspecified": 0.0})
    assert tiers.distrusted(A)
    check.on_counters(A, {"external_unspecified": 600.0})
    assert tiers.distrusted(A)  # not yet min_tokens of them
    check.on_counters(A, {"external_unspecified": 1200.0})
    assert not tiers.distrusted(A)


def test_a_p2p_decode_leg_and_a_new_engine_run_are_not_counted_against_it() -> None:
    tiers, check = _setup()
    for _ in range(4):  # the decode leg of P/D: its prompt came over NIXL
        _served(check, TierHold(l1=320), path=Path.PD)
    check.on_counters(A, {"external_unspecified": 0.0})
    assert not tiers.distrusted(A)
    for _ in range(4):
        _served(check, TierHold(l1=320))
    check.on_counters(A, {"external_unspecified": 0.0}, restarted=True)  # a new run: counting starts over
    assert not tiers.distrusted(A) and check.state()[A].ratio == {}


def test_an_engine_without_the_counters_and_a_check_turned_off_judge_nothing() -> None:
    tiers = TierIndex(l1_capacity=lambda url: 100)
    check = TierCounterCheck(tiers, min_tokens=100)
    check.on_counters(A, None)  # an engine older than vLLM 0.32's counters
    for _ in range(4):
        _served(check, TierHold(l1=320))
    check.on_counters(A, None)
    assert not tiers.distrusted(A) and A not in check.state()
    tiers2, on = _setup()
    for _ in range(4):
        _served(on, TierHold(l1=320))
    on.on_counters(A, {"external_unspecified": 0.0})
    assert tiers2.distrusted(A)
    on.configure(enabled=False, min_tokens=1000, distrust_below=0.5)
    assert not tiers2.distrusted(A)  # turning the check off trusts again
