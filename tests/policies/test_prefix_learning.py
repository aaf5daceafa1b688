"""The prefix-cache learner: tentative beliefs while a request is in flight, confirmed when the
engine has the prompt's KV, retracted when it never got it, corrected by the engine's own count."""

from __future__ import annotations

from policies.base import Decision, EndpointView, Finished, LegOutcome, LegReport, Path, RequestContext
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import InFlightPrefixes, PrefixBeliefs

BS = 16
P, D = "http://p", "http://d"


def ctx(hashes: list[int], *, settled: dict[str, int] | None = None, rid: str = "r") -> RequestContext:
    tokens = list(range(len(hashes) * BS + 1))
    return RequestContext(
        "m", rid, tokens, block_hashes=hashes, block_size=BS, settled_tokens=settled or {}, cached_tokens=settled or {}
    )


def decision(pd: bool = True) -> Decision:
    return Decision(
        Path.PD if pd else Path.DIRECT,
        EndpointView(D, "decode", True, 0),
        EndpointView(P, "prefill", True, 0) if pd else None,
        "test",
    )


def leg(url: str, outcome: LegOutcome, cached: int | None = None) -> LegReport:
    return LegReport("prefill" if url == P else "decode", url, outcome, Path.PD, 0.1, cached_tokens=cached)


def done(beliefs: PrefixBeliefs, c: RequestContext, d: Decision) -> None:
    beliefs.on_finished(c, d, Finished(200, d.path.value, (), 0.1))


class FakeShared:
    def __init__(self) -> None:
        self.learned: list[tuple[str, list]] = []
        self.forgotten: list[str] = []

    def learn(self, url, hashes) -> None:
        self.learned.append((url, list(hashes)))

    def forget(self, url, until) -> None:
        self.forgotten.append(url)


def test_in_flight_prompts_count_until_removed_and_equal_prompts_count_separately():
    flight = InFlightPrefixes()
    a, b = [1, 2, 3, 4], [1, 2, 3, 4]  # two requests, the same prompt
    flight.add(D, a)
    flight.add(D, b)
    assert flight.extend([1, 2, 3, 9], {}) == {D: 3}
    flight.remove(D, a)
    assert flight.extend([1, 2, 3, 4, 5], {P: 2}) == {P: 2, D: 4}  # b is still in flight
    flight.remove(D, b)
    assert flight.extend([1, 2], {P: 2}) == {P: 2} and len(flight) == 0


def test_a_routed_prompt_is_tentative_until_its_leg_confirms_it():
    index = PrefixIndex()
    beliefs = PrefixBeliefs(index)
    hashes = [1, 2, 3, 4]
    c, d = ctx(hashes), decision()
    beliefs.on_routed(c, d)
    assert beliefs.in_flight.extend(hashes, {}) == {D: 4, P: 4}  # a burst sees it at once
    assert index.match(hashes) == {}  # but nothing is settled yet
    beliefs.on_leg_done(c, leg(P, LegOutcome.OK))
    beliefs.on_leg_done(c, leg(D, LegOutcome.CUT))  # broke off after its first token: it had the KV
    done(beliefs, c, d)
    assert index.match(hashes) == {D: 4, P: 4}
    assert len(beliefs.in_flight) == 0


def test_refused_unreached_failed_and_abandoned_legs_are_retracted():
    for outcome in (LegOutcome.REJECTED, LegOutcome.UNREACHED, LegOutcome.FAILED, LegOutcome.ABANDONED):
        index = PrefixIndex()
        beliefs = PrefixBeliefs(index)
        hashes = [1, 2, 3]
        c, d = ctx(hashes), decision()
        beliefs.on_routed(c, d)
        beliefs.on_leg_done(c, leg(P, outcome))
        done(beliefs, c, d)  # the decode leg never ran
        assert index.match(hashes) == {}, outcome
        assert beliefs.in_flight.extend(hashes, {}) == {}, outcome


def test_a_retracted_prompt_leaves_what_an_earlier_request_confirmed():
    index = PrefixIndex()
    beliefs = PrefixBeliefs(index)
    turn1, turn2 = [1, 2, 3], [1, 2, 3, 4, 5]
    c1, d = ctx(turn1), decision(pd=False)
    beliefs.on_routed(c1, d)
    beliefs.on_leg_done(c1, leg(D, LegOutcome.OK))
    done(beliefs, c1, d)
    c2 = ctx(turn2, rid="r2")
    beliefs.on_routed(c2, d)
    beliefs.on_leg_done(c2, leg(D, LegOutcome.REJECTED))
    done(beliefs, c2, d)
    assert index.match(turn2) == {D: 3}


def test_engines_without_prefix_caching_get_no_beliefs():
    index = PrefixIndex()
    beliefs = PrefixBeliefs(index, caching_off=lambda url: url == D)
    hashes = [1, 2]
    c, d = ctx(hashes), decision()
    beliefs.on_routed(c, d)
    assert beliefs.in_flight.extend(hashes, {}) == {P: 2}
    beliefs.on_leg_done(c, leg(P, LegOutcome.OK))
    beliefs.on_leg_done(c, leg(D, LegOutcome.OK))
    done(beliefs, c, d)
    assert index.match(hashes) == {P: 2}


def test_confirmed_prompts_reach_the_shared_state():
    shared = FakeShared()
    beliefs = PrefixBeliefs(PrefixIndex(), shared=shared)
    c, d = ctx([7, 8]), decision(pd=False)
    beliefs.on_routed(c, d)
    assert shared.learned == []  # tentative beliefs stay local
    beliefs.on_leg_done(c, leg(D, LegOutcome.OK))
    assert shared.learned == [(D, [7, 8])]


def test_an_engine_serving_less_than_settled_loses_what_was_learned_as_long_ago():
    """The engine evicts least recently used blocks first: a settled block found gone takes the
    blocks learned at or before it with it; later ones stay."""
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    shared = FakeShared()
    beliefs = PrefixBeliefs(index, shared=shared, clock=lambda: now[0], wall=lambda: 1000 + now[0])
    old_chat, other_old, recent = [1, 2, 3, 4], [50, 51], [90, 91, 92]
    index.learn(D, old_chat)
    index.learn(D, other_old)
    now[0] = 200.0
    index.learn(D, recent)
    # The old chat comes back: believed 4 blocks, the engine served 1 from its cache.
    c = ctx([*old_chat, 5], settled={D: 4 * BS})
    beliefs.on_routed(c, decision(pd=False))
    beliefs.on_leg_done(c, LegReport("decode", D, LegOutcome.OK, Path.DIRECT, 0.1, cached_tokens=BS))
    assert index.match(other_old) == {}  # learned as long ago: gone too
    assert index.match(recent) == {D: 3}  # learned later: kept
    assert index.match([*old_chat, 5]) == {D: 5}  # and this request's prompt is confirmed afresh
    assert shared.forgotten == [D] and beliefs.evicted == len(old_chat) + len(other_old)


def test_an_engine_serving_what_was_believed_changes_nothing():
    index = PrefixIndex()
    beliefs = PrefixBeliefs(index)
    index.learn(D, [50, 51])
    index.learn(D, [1, 2, 3])
    c = ctx([1, 2, 3, 4], settled={D: 3 * BS})
    beliefs.on_routed(c, decision(pd=False))
    beliefs.on_leg_done(c, LegReport("decode", D, LegOutcome.OK, Path.DIRECT, 0.1, cached_tokens=3 * BS))
    assert index.match([50, 51]) == {D: 2} and beliefs.evicted == 0


def test_forget_drops_learned_and_event_entries_of_a_restarted_engine():
    index = PrefixIndex()
    shared = FakeShared()
    beliefs = PrefixBeliefs(index, shared=shared)
    index.learn(D, [1, 2])
    index.stored(D, [1, 2, 3])
    index.learn(P, [1, 2])
    beliefs.forget(D)
    assert index.match([1, 2, 3]) == {P: 2} and shared.forgotten == [D]
