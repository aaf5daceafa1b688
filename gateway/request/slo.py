"""Can a request still meet its TTFT objective? The cost model's prediction (policies/cost_model.py)
of the engine side, plus what the request has waited already and the prefill work queued ahead of
it. A sheddable request that cannot is answered 429 at once, rather than left to fail late."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from policies.base import Decision, EndpointView, RequestContext
from policies.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class Verdict:
    objective_s: float
    predicted_s: float  # time to first token from arrival, on the best path
    waited_s: float
    queue_s: float  # the estimated wait for the queue ahead
    engine_s: float  # the engine side (prefill queue and prompt, hand-over)
    path: str  # the path predicted best

    @property
    def met(self) -> bool:
        return self.predicted_s <= self.objective_s

    def describe(self) -> str:
        return (
            f"predicted TTFT {self.predicted_s * 1000:.0f} ms (waited {self.waited_s * 1000:.0f}, queue "
            f"{self.queue_s * 1000:.0f}, engine {self.engine_s * 1000:.0f} on {self.path}) vs objective "
            f"{self.objective_s * 1000:.0f} ms"
        )


def model_of(decider: object) -> CostModel:
    """The routing's own cost model when it uses one (its learned speeds and hand-over), else the
    defaults: the engines' measured speeds still apply, through the endpoint views."""
    return decider if isinstance(decider, CostModel) else _default_model()


@functools.cache
def _default_model() -> CostModel:
    return CostModel()  # immutable; validating its fields costs ~11 us, once


def engine_ttft(
    model: CostModel, ctx: RequestContext, decode: EndpointView, prefill: EndpointView | None
) -> tuple[float, str]:
    """The engine side of the best path: (seconds, path)."""
    if prefill is None:
        spt = decode.prefill_s_per_token or model.decode_prefill_factor / model.prefill_tokens_per_s
        return (decode.backlog_tokens + ctx.uncached(decode.url)) * spt, "direct"
    direct, pd = model.predict(ctx, decode, prefill)
    return (direct, "direct") if direct <= pd else (pd, "pd")


def decision_ttft(model: CostModel, ctx: RequestContext, d: Decision) -> tuple[float, str]:
    """The decision's own prediction when its decider made one, else the model's."""
    if d.predicted_ttft:
        path, seconds = min(d.predicted_ttft, key=lambda p: p[1])
        return seconds, path
    return engine_ttft(model, ctx, d.decode, d.prefill)


def queue_wait(model: CostModel, tokens_ahead: int, prefill_pool: list[EndpointView]) -> float:
    """The prefill pool's time for the uncached tokens queued ahead (its engines in parallel)."""
    up = [v for v in prefill_pool if v.healthy]
    if not tokens_ahead or not up:
        return 0.0
    spt = min(v.prefill_s_per_token or 1 / model.prefill_tokens_per_s for v in up)
    return tokens_ahead * spt / len(up)


def verdict(objective_s: float, waited_s: float, queue_s: float, engine: tuple[float, str]) -> Verdict:
    return Verdict(objective_s, waited_s + queue_s + engine[0], waited_s, queue_s, engine[0], engine[1])
