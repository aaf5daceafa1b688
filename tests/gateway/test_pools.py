"""Passive health: endpoints whose requests fail are ejected, then tried again."""

from __future__ import annotations

from gateway.config import OutlierConfig
from gateway.engines.pools import Pools


class Clock:
    """The pools' clock, moved by the test (nothing else in the process sees it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pools(clock: Clock | None = None, **cfg) -> Pools:
    p = Pools([], ["http://d0", "http://d1"], outlier=OutlierConfig(**cfg), clock=clock or Clock())
    for e in p.all():
        e.healthy = True
    return p


def usable(p: Pools) -> list[str]:
    return [v.url for v in p.snapshot().decode if v.healthy]


def test_consecutive_failures_eject_then_the_endpoint_comes_back():
    clock = Clock()
    p = pools(clock, consecutive_failures=3, base_ejection_s=5)
    d0 = p.decode[0]
    d0.record(False)
    d0.record(False)
    assert usable(p) == ["http://d0", "http://d1"]
    d0.record(False)
    assert usable(p) == ["http://d1"] and d0.ejected and p.ready()
    clock.now += 5.1
    assert usable(p) == ["http://d0", "http://d1"]  # tried again with real traffic


def test_ejection_time_doubles_while_it_keeps_failing_and_resets_after_a_clean_window():
    clock = Clock()
    p = pools(clock, consecutive_failures=1, base_ejection_s=2, max_ejection_s=5, window=3, min_requests=3)
    d0 = p.decode[0]
    lengths = []
    for _ in range(4):
        d0.record(False)
        lengths.append(round(d0.ejected_until - clock.now, 3))
        clock.now = d0.ejected_until + 0.01
    assert lengths == [2, 4, 5, 5]  # capped at max_ejection_s
    for _ in range(3):
        d0.record(True)
    d0.record(False)
    assert round(d0.ejected_until - clock.now, 3) == 2


def test_error_rate_ejects_even_without_a_run_of_failures():
    p = pools(consecutive_failures=100, error_rate=0.5, window=10, min_requests=10)
    d0 = p.decode[0]
    for i in range(9):
        d0.record(i % 2 == 0)  # 5 ok, 4 failed
    assert not d0.ejected
    d0.record(False)  # 5 of 10 failed
    assert d0.ejected


def test_not_ready_when_every_decode_endpoint_is_ejected():
    p = pools(consecutive_failures=1)
    for e in p.decode:
        e.record(False)
    assert not p.ready() and usable(p) == []
