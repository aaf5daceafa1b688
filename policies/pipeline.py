"""The routing pipeline the YAML describes: per pool filters -> weighted scorers -> picker, then the
decider chooses the path once the decode endpoint is known. Before any of it, once per request, the
policies that publish per-request data (``base.Publisher``) do (``RoutingPipeline.publish``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from .base import (
    Decider,
    Decision,
    EndpointView,
    Filter,
    NoPairing,
    Path,
    Picker,
    PoolSnapshot,
    Publisher,
    RequestContext,
    Scorer,
)


class NoEndpointError(RuntimeError):
    """No healthy decode endpoint: nothing can serve the request."""


@dataclass(frozen=True)
class Weighted:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True)
class PoolPipeline:
    """How one pool chooses an endpoint. A filter that would leave no candidate is skipped for that
    request (a full cluster should queue, not fail), unless it raises ``NoPairing``, which ``choose``
    passes on."""

    picker: Picker
    filters: tuple[tuple[str, Filter], ...] = ()
    scorers: tuple[Weighted, ...] = ()
    picker_name: str = "picker"

    def members(self, pool: str) -> list[tuple[str, object]]:
        """Its policies, each named by where the config puts it (e.g. ``decode.scorers.load``)."""
        return [
            *((f"{pool}.filters.{name}", f) for name, f in self.filters),
            *((f"{pool}.scorers.{w.name}", w.scorer) for w in self.scorers),
            (f"{pool}.picker.{self.picker_name}", self.picker),
        ]

    def choose(
        self, ctx: RequestContext, endpoints: Sequence[EndpointView], trace: list[dict[str, Any]] | None = None
    ) -> EndpointView | None:
        candidates: Sequence[EndpointView] = [e for e in endpoints if e.healthy]
        if not candidates:
            return None
        if len(candidates) == 1 and trace is None and (ctx.paired is None or not self.filters):
            # nothing to choose between: filters are soft, scores would not matter (a pairing
            # filter may still refuse the one candidate)
            return candidates[0]
        for name, f in self.filters:
            try:
                kept = f.filter(ctx, candidates)
            except NoPairing as err:
                if trace is not None:
                    trace.append({"filter": name, "kept": [], "no_pairing": err.reason})
                raise
            if trace is not None:
                trace.append({"filter": name, "kept": [e.url for e in kept]})
            if kept:
                candidates = kept
        totals = [0.0] * len(candidates)
        weight_sum = sum(w.weight for w in self.scorers)
        for w in self.scorers:
            scores = w.scorer.score(ctx, candidates)
            for i, s in enumerate(scores):
                totals[i] += w.weight * min(max(s, 0.0), 1.0)
            if trace is not None:
                trace.append(
                    {
                        "scorer": w.name,
                        "weight": w.weight,
                        "scores": {e.url: round(s, 4) for e, s in zip(candidates, scores, strict=True)},
                    }
                )
        if weight_sum:
            totals = [t / weight_sum for t in totals]
        chosen = self.picker.pick(ctx, candidates, totals)
        if trace is not None:
            trace.append(
                {"picked": chosen.url, "totals": {e.url: round(t, 4) for e, t in zip(candidates, totals, strict=True)}}
            )
        return chosen


@dataclass(frozen=True)
class Route:
    """A decision plus, when asked for, how it was reached (for ``POST /debug/route``)."""

    decision: Decision
    trace: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class RoutingPipeline:
    decider: Decider
    decode: PoolPipeline
    prefill: PoolPipeline
    decider_name: str = "decider"

    def members(self) -> list[tuple[str, object]]:
        """Every policy instance, named by its place in the config (the lifecycle hooks' subscribers)."""
        return [
            (f"decider.{self.decider_name}", self.decider),
            *self.decode.members("decode"),
            *self.prefill.members("prefill"),
        ]

    @cached_property
    def publishers(self) -> tuple[Publisher, ...]:
        """The policies that publish per-request data, in ``members`` order, each object once."""
        found: list[Publisher] = []
        for _, policy in self.members():
            if isinstance(policy, Publisher) and not any(policy is p for p in found):
                found.append(policy)
        return tuple(found)

    def publish(self, ctx: RequestContext) -> None:
        """Let each publisher put its per-request data in ``ctx.data`` (once per request, before
        ``route``: the gateway does it when it prepares the request)."""
        for policy in self.publishers:
            policy.publish(ctx)

    def route(self, ctx: RequestContext, pools: PoolSnapshot, *, explain: bool = False) -> Route:
        traces: dict[str, list[dict[str, Any]]] = {"decode": [], "prefill": []} if explain else {}
        decode = self.decode.choose(ctx, pools.decode, traces.get("decode"))
        if decode is None:
            raise NoEndpointError("no healthy decode endpoint")
        fallback: list[str] = []
        picked: list[EndpointView | None] = []

        def find_prefill() -> EndpointView | None:
            if not picked:  # at most once per request, however often the decider asks
                if ctx.local_only:
                    fallback.append(ctx.local_only)
                    picked.append(None)
                else:
                    try:
                        ep = self.prefill.choose(replace(ctx, paired=decode), pools.prefill, traces.get("prefill"))
                    except NoPairing as err:
                        ep = None
                        fallback.append(err.reason)
                    else:
                        if ep is None:
                            fallback.append("no_prefill_endpoint")
                    picked.append(ep)
            return picked[0]

        choice = self.decider.decide(ctx, decode, find_prefill)
        if choice.path is Path.PD:
            prefill = find_prefill()
            if prefill is None:
                why = fallback[0]
                decision = Decision(Path.DIRECT, decode, None, why, f"{choice.detail}; {why}", choice.predicted_ttft)
            else:
                decision = Decision(Path.PD, decode, prefill, choice.reason, choice.detail, choice.predicted_ttft)
        else:
            decision = Decision(Path.DIRECT, decode, None, choice.reason, choice.detail, choice.predicted_ttft)
        return Route(decision, traces)
