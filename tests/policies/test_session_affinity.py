from __future__ import annotations

import pytest

from policies.session_affinity import SessionAffinity

from .helpers import ctx, ep

EPS = [ep(f"http://d{i}") for i in range(4)]


def chosen(policy: SessionAffinity, session: str, eps=EPS) -> str:
    scores = policy.score(ctx(1, headers={"x-session-id": session}), eps)
    assert sorted(scores) == [0.0] * (len(eps) - 1) + [1.0]
    return eps[scores.index(1.0)].url


def test_a_session_sticks_to_one_endpoint():
    policy = SessionAffinity()
    assert len({chosen(policy, "alice") for _ in range(10)}) == 1


def test_sessions_spread_over_endpoints():
    policy = SessionAffinity()
    assert len({chosen(policy, f"s{i}") for i in range(200)}) == 4


def test_removing_an_endpoint_moves_only_its_sessions():
    policy = SessionAffinity()
    before = {f"s{i}": chosen(policy, f"s{i}") for i in range(300)}
    after = {s: chosen(policy, s, EPS[:3]) for s in before}
    moved = [s for s in before if before[s] != after[s]]
    assert moved and all(before[s] == "http://d3" for s in moved)


def test_bounded_load_passes_a_session_on_when_its_endpoint_is_overloaded():
    policy = SessionAffinity(load_factor=1.25)
    home = chosen(policy, "alice")
    busy = [ep(e.url, in_flight=20 if e.url == home else 0) for e in EPS]
    assert chosen(policy, "alice", busy) != home


def test_no_header_no_preference():
    assert SessionAffinity().score(ctx(1), EPS) == [0.0] * 4


def test_header_name_is_configurable():
    policy = SessionAffinity(header="X-Conversation")
    assert 1.0 in policy.score(ctx(1, headers={"x-conversation": "c1"}), EPS)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"load_factor": 0.5}, "load_factor: Input should be greater than or equal to 1"),
        ({"header": ""}, "header: String should have at least 1 character"),
        ({"vnodes": 0}, "vnodes: Input should be greater than 0"),
        ({"vnodes": True}, "vnodes: Input should be a valid integer"),
    ],
)
def test_rejects_bad_params(bad, message):
    with pytest.raises(ValueError, match=message):
        SessionAffinity(**bad)


def test_ring_cache_is_a_bounded_lru(monkeypatch):
    """Rings are kept per candidate set, least recently used dropped first (not all at once)."""
    monkeypatch.setattr("policies.session_affinity.RING_CACHE_SIZE", 3)
    policy = SessionAffinity()
    sets = [EPS[:2], EPS[:3], EPS[1:]]
    for eps in sets:
        chosen(policy, "alice", eps)
    chosen(policy, "alice", sets[0])  # used again: now the most recent
    chosen(policy, "alice", EPS)  # a fourth set evicts the least recently used one, sets[1]
    keys = {tuple(sorted(e.url for e in eps)) for eps in (sets[0], sets[2], EPS)}
    assert set(policy._rings) == keys
    assert len(policy._rings) == 3
