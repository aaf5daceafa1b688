"""Calling the lifecycle hooks (``policies.base.Lifecycle``) of every subscriber, in order.

Subscribers are the gateway's own learners (the prefix beliefs, the measured speeds, the belief
audit) and any policy of the pipeline that defines a hook, third-party ones included. A hook that
raises is logged (once per subscriber and hook, then counted) and never reaches the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from .base import HOOKS, Decision, Finished, LegReport, RequestContext

log = logging.getLogger(__name__)

OnError = Callable[[str, str], None]  # (subscriber name, hook name)


class Hooks:
    """The hooks of ``subscribers`` ((name, object) pairs): only the methods they define are called."""

    def __init__(self, subscribers: Iterable[tuple[str, object]], on_error: OnError | None = None) -> None:
        subs = list(subscribers)
        self.names = tuple(name for name, _ in subs)
        self._on_error = on_error
        self._logged: set[tuple[str, str]] = set()
        by_hook: dict[str, list[tuple[str, Callable[..., Any]]]] = {hook: [] for hook in HOOKS}
        for name, sub in subs:
            for hook in HOOKS:
                fn = getattr(sub, hook, None)
                if callable(fn):
                    by_hook[hook].append((name, fn))
        self._routed = tuple(by_hook["on_routed"])
        self._leg_done = tuple(by_hook["on_leg_done"])
        self._finished = tuple(by_hook["on_finished"])

    def routed(self, ctx: RequestContext, decision: Decision) -> None:
        for name, fn in self._routed:
            try:
                fn(ctx, decision)
            except Exception:
                self._failed(name, "on_routed")

    def leg_done(self, ctx: RequestContext, leg: LegReport) -> None:
        for name, fn in self._leg_done:
            try:
                fn(ctx, leg)
            except Exception:
                self._failed(name, "on_leg_done")

    def finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        for name, fn in self._finished:
            try:
                fn(ctx, decision, result)
            except Exception:
                self._failed(name, "on_finished")

    def _failed(self, name: str, hook: str) -> None:
        if (name, hook) not in self._logged:  # the first failure with its traceback; later ones counted
            self._logged.add((name, hook))
            log.exception("%s.%s failed (further failures are only counted in pdgate_hook_errors_total)", name, hook)
        if self._on_error is not None:
            self._on_error(name, hook)


def policy_hooks(policies: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
    """The policies among ``policies`` that define at least one hook."""
    return [(name, p) for name, p in policies if any(callable(getattr(p, h, None)) for h in HOOKS)]
