"""gateway/http/connections.py: the open-connection cap refuses past its limit and counts what it
refused, the wait is smoothed, and ``stopping`` is unset until the server begins shutting down."""

from __future__ import annotations

from gateway.http.connections import SMOOTHING, Connections


def test_the_cap_refuses_past_its_limit_and_frees_a_place_on_leave() -> None:
    c = Connections(2)
    assert c.enter() and c.enter()
    assert not c.enter() and c.refused == 1 and c.open == 2
    c.leave()
    assert c.enter() and c.open == 2
    assert Connections(0).enter()  # 0: no cap


def test_one_slow_accept_moves_the_wait_by_its_weight_only() -> None:
    c = Connections(10)
    c.waited(1.0)
    assert c.wait_s == SMOOTHING
    assert not c.stopping.is_set()
