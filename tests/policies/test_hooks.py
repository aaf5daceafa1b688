"""The lifecycle hooks' fan-out: only the methods a subscriber defines, in order, failures isolated."""

from __future__ import annotations

from policies.base import Decision, EndpointView, Finished, LegOutcome, LegReport, Path, RequestContext
from policies.hooks import Hooks, policy_hooks

CTX = RequestContext("m", "r", [1, 2, 3])
DECISION = Decision(Path.DIRECT, EndpointView("http://d", "decode", True, 0), None, "short_prompt")
LEG = LegReport("decode", "http://d", LegOutcome.OK, Path.DIRECT, 0.1)
DONE = Finished(200, "direct", (LEG,), 0.2)


class Log:
    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def on_routed(self, ctx, decision):
        self.seen.append((self.name, "routed", decision.reason))

    def on_leg_done(self, ctx, leg):
        self.seen.append((self.name, "leg", leg.outcome.value))


class OnlyFinished:
    def __init__(self, seen: list) -> None:
        self.seen = seen

    def on_finished(self, ctx, decision, result):
        self.seen.append(("finished", result.status))


class Raises:
    def on_routed(self, ctx, decision):
        raise ValueError("bug")


def test_each_subscriber_gets_the_hooks_it_defines_in_order():
    seen: list = []
    hooks = Hooks([("a", Log("a", seen)), ("f", OnlyFinished(seen)), ("b", Log("b", seen))])
    hooks.routed(CTX, DECISION)
    hooks.leg_done(CTX, LEG)
    hooks.finished(CTX, DECISION, DONE)
    assert seen == [
        ("a", "routed", "short_prompt"),
        ("b", "routed", "short_prompt"),
        ("a", "leg", "ok"),
        ("b", "leg", "ok"),
        ("finished", 200),
    ]


def test_a_failing_hook_is_counted_and_the_rest_still_run(caplog):
    seen: list = []
    errors: list = []
    hooks = Hooks([("bad", Raises()), ("a", Log("a", seen))], lambda *a: errors.append(a))
    hooks.routed(CTX, DECISION)
    hooks.routed(CTX, DECISION)
    assert seen == [("a", "routed", "short_prompt")] * 2
    assert errors == [("bad", "on_routed")] * 2
    assert sum("bad.on_routed failed" in r.message for r in caplog.records) == 1  # logged once, then counted


def test_only_policies_with_a_hook_subscribe():
    plain = object()
    assert [name for name, _ in policy_hooks([("p", plain), ("q", Raises()), ("r", OnlyFinished([]))])] == ["q", "r"]
