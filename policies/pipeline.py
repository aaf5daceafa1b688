"""Decider then picker: the routing pipeline the YAML describes."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Decider, Decision, EndpointView, Path, Picker, PoolSnapshot, RequestContext


class NoEndpointError(RuntimeError):
    """No healthy decode endpoint: nothing can serve the request."""


@dataclass(frozen=True)
class RoutingPipeline:
    decider: Decider
    picker: Picker

    def route(self, ctx: RequestContext, pools: PoolSnapshot) -> Decision:
        decode = _healthy(pools.decode)
        if not decode:
            raise NoEndpointError("no healthy decode endpoint")
        choice = self.decider.decide(ctx, pools)
        if choice.path is Path.PD:
            if ctx.local_only:
                return self._direct(ctx, decode, ctx.local_only, f"{choice.detail}; {ctx.local_only}")
            prefill = _healthy(pools.prefill)
            if not prefill:
                return self._direct(ctx, decode, "no_prefill_endpoint", f"{choice.detail}; no healthy prefill")
            return Decision(
                Path.PD,
                decode=self.picker.pick(ctx, decode),
                prefill=self.picker.pick(ctx, prefill),
                reason=choice.reason,
                detail=choice.detail,
            )
        return self._direct(ctx, decode, choice.reason, choice.detail)

    def _direct(
        self, ctx: RequestContext, decode: list[EndpointView], reason: str, detail: str
    ) -> Decision:
        return Decision(Path.DIRECT, self.picker.pick(ctx, decode), None, reason, detail)


def _healthy(endpoints: tuple[EndpointView, ...]) -> list[EndpointView]:
    return [e for e in endpoints if e.healthy]
