"""One request's wait for room on the engines, and its TTFT objective's check.

A request that finds no room waits in the queue of the pool it needs (prefill or decode; one per
model, gateway/fairness/fairqueue.py), served in the queue's order: FIFO, or by priority class and the
tenant's weighted use of that pool. A new request does not pass one that waits before it; one
that finds room passes the turn on (the next may find room too). While it waits, and once
routed, a sheddable request whose predicted TTFT exceeds its objective (gateway/request/slo.py) is
answered 429 at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from typing import Any

from gateway.context import Runtime, Services
from gateway.fairness.admission import too_busy
from gateway.fairness.fairqueue import FairQueue, QueueFull, Waiter
from gateway.fairness.tenants import Identity
from gateway.http.errors import APIError
from gateway.ops.requestlog import RequestRecord
from gateway.request.router import NotServed, Prepared, Saturated
from gateway.request.slo import Verdict, decision_ttft, engine_ttft, model_of, queue_wait, verdict
from policies.base import Decision, RequestContext
from policies.cost_model import CostModel
from policies.pipeline import NoEndpointError, Route

QUEUE_SLICE_S = 0.25  # a queued request looks again this often (room other replicas free is not signalled)


class Room:
    """Finds a request its route, waiting for room as needed; one per request (``who`` and
    ``rec`` are the request's)."""

    def __init__(self, rt: Runtime, svc: Services, who: Identity | None, rec: RequestRecord) -> None:
        self.rt, self.svc, self.who, self.rec = rt, svc, who, rec
        self.verdict: Verdict | None = None  # the TTFT objective's last check

    async def pick(
        self,
        prep: Prepared,
        deadline: float,
        *,
        explain: bool = False,
        exclude: Collection[str] = (),
        sheddable: bool = True,
    ) -> tuple[Route, float]:
        """The route, waiting for engine capacity until ``deadline``; and how long it waited.

        A request that finds no room waits in the queue of the pool it needs (prefill or decode),
        served in the queue's order; a new request does not pass one that waits before it. A
        sheddable request whose TTFT objective cannot be met leaves with 429 as soon as that is known
        (not a continuation: ``sheddable`` False)."""
        adm = self.rt.cfg.admission
        waited = 0.0
        w: Waiter | None = None
        queue: FairQueue | None = None
        routed = False
        try:
            while True:
                route, phase = self._route_or_wait(prep, explain, exclude, first=w is None)
                if route is not None:
                    if sheddable:
                        self._check_objective(prep, route.decision, explain=explain)
                    routed = True
                    return route, waited
                left = deadline - time.monotonic()
                if left <= 0:
                    raise too_busy(adm, f"every {phase} engine is at its limit")
                q = self._queue(phase, prep)
                if w is None or queue is not q:
                    if w is not None and queue is not None:
                        _leave(queue, w, routed=False)  # now it needs the other pool
                        w = queue = None
                    try:
                        w = q.join(self.who, _uncached(prep.ctx) if phase == "prefill" else 0)
                    except QueueFull as full:
                        self.svc.metrics.rejected(full.why)
                        raise too_busy(adm, f"too many requests waiting for the {phase} pool") from None
                    queue = q
                elif w.fut.done():  # it was served, but found no room: first in line again
                    q.requeue(w)
                    if exclude:  # the room may be on an engine it must not use: the next one looks
                        q.pass_on(w)
                shed_in = (
                    self._check_objective(prep, None, queue=q, waiter=w, exclude=exclude) if sheddable else math.inf
                )
                waited += await wait_for_room(q, w, min(left, shed_in))
        finally:
            if w is not None and queue is not None:
                _leave(queue, w, routed)

    def _route_or_wait(
        self, prep: Prepared, explain: bool, exclude: Collection[str], *, first: bool
    ) -> tuple[Route | None, str]:
        """The route, or the pool to wait for: a pool at its limits, or (``first`` try) one where
        someone waits who goes first."""
        adm, fair = self.rt.cfg.admission, self.rt.cfg.fairness
        if first and not explain and self._queue("decode", prep).before(self.who):
            return None, "decode"  # room there is for those who wait first
        retry_after = {"Retry-After": str(math.ceil(adm.retry_after_s))}
        try:
            route = self.rt.router.route(
                prep,
                explain=explain,
                max_decode=adm.max_per_decode_endpoint,
                max_prefill=adm.max_per_prefill_endpoint,
                exclude=exclude,
                wait_for_prefill=fair.enabled and fair.wait_for_prefill and not explain,
            )
        except NotServed:
            raise APIError(
                503,
                f"No decode engine serves the model `{prep.ctx.model}` right now (see /ready).",
                code="model_not_served",
                headers=retry_after,
            ) from None
        except NoEndpointError:
            raise APIError(
                503,
                "No decode engine is available right now.",
                code="no_healthy_endpoint",
                type_="server_error",
                headers=retry_after,
            ) from None
        except Saturated as sat:
            if explain:
                raise too_busy(adm, f"every {sat.phase} engine is at its limit") from None
            return None, sat.phase
        if (
            first
            and not explain
            and route.decision.prefill is not None
            and self._queue("prefill", prep).before(self.who)
        ):
            return None, "prefill"
        return route, ""

    def _queue(self, phase: str, prep: Prepared) -> FairQueue:
        return self.svc.queue(phase, prep.ctx.model)

    def _model(self) -> CostModel:
        """What predicts TTFT for the objectives."""
        return model_of(self.rt.router.pipeline.decider)

    def _check_objective(
        self,
        prep: Prepared,
        decision: Decision | None,
        *,
        explain: bool = False,
        queue: FairQueue | None = None,
        waiter: Waiter | None = None,
        exclude: Collection[str] = (),
    ) -> float:
        """Sheds a sheddable request that cannot meet its TTFT objective (429 with Retry-After);
        returns how long it may wait before that is so (inf: it has no objective, or may not be shed).
        ``decision``: the route found; None: queued."""
        who, fair = self.who, self.rt.cfg.fairness
        if who is None or who.ttft_slo_s is None or not fair.enabled:
            return math.inf
        model = self._model()
        queued_s = 0.0
        if decision is not None:
            engine = decision_ttft(model, prep.ctx, decision)
        else:  # queued: the engines' side without limits, and the prefill work ahead
            try:
                route = self.rt.router.route(prep, exclude=exclude)
            except (NotServed, NoEndpointError, Saturated):
                return math.inf
            d = route.decision
            engine = engine_ttft(model, prep.ctx, d.decode, d.prefill)
            if queue is not None and waiter is not None and queue.phase == "prefill":
                queued_s = queue_wait(model, queue.ahead(waiter)[1], list(self.svc.pools.snapshot().prefill))
        since = self.rec.since_start()
        v = self.verdict = verdict(who.ttft_slo_s, since, queued_s, engine)
        if v.met or not who.sheddable:
            return max(0.0, v.objective_s - v.predicted_s) if who.sheddable else math.inf
        if explain:
            return 0.0
        self.svc.metrics.decided("shed", "ttft_objective")
        self.svc.metrics.tenant_shed(self.rec.tenant_label, who.cls)
        self.rec.reason = "ttft_objective"
        late = math.ceil(max(self.rt.cfg.admission.retry_after_s, v.predicted_s - v.objective_s))
        # Retry-After says when a retry may succeed: none when the prompt alone misses the objective.
        retry = v.engine_s <= v.objective_s
        hint = (
            f"retry after {late} s"
            if retry
            else "its prompt alone is predicted to take longer than the objective: a retry will not meet it either"
        )
        raise APIError(
            429,
            f"This request's TTFT objective cannot be met: {v.describe()}; {hint}.",
            code="ttft_objective_unattainable",
            headers={"Retry-After": str(late)} if retry else None,
        )

    def view(self) -> dict[str, Any]:
        """For ``/debug/route``: who the request is for and its objective's check."""
        who = self.who
        if who is None:
            return {}
        return {
            "tenant": who.tenant,
            "priority": who.cls,
            "priority_value": who.priority,
            "ttft_objective_s": who.ttft_slo_s,
            "sheddable": who.sheddable,
            "fairness": self.rt.cfg.fairness.enabled,
            **_verdict_view(self.verdict if self.rt.cfg.fairness.enabled else None, who.sheddable),
        }


def _verdict_view(v: Verdict | None, sheddable: bool) -> dict[str, Any]:
    if v is None:
        return {"predicted_ttft_s": None, "verdict": "admit", "reason": "no TTFT objective"}
    if v.met:
        verdict_, reason = "admit", "objective met"
    else:
        verdict_, reason = (
            ("shed", "objective cannot be met") if sheddable else ("wait", "objective cannot be met; not sheddable")
        )
    return {
        "predicted_ttft_s": round(v.predicted_s, 6),
        "engine_ttft_s": round(v.engine_s, 6),
        "queue_s": round(v.queue_s, 6),
        "waited_s": round(v.waited_s, 6),
        "best_path": v.path,
        "verdict": verdict_,
        "reason": f"{reason}: {v.describe()}",
    }


async def wait_for_room(q: FairQueue, w: Waiter, limit_s: float) -> float:
    """Until woken (room freed), ``limit_s`` passes, or it is next in line at a look (room other
    replicas free is not signalled); the time waited."""
    waited = 0.0
    while True:
        w0 = time.perf_counter()
        woken = await q.wait(w, min(limit_s - waited, QUEUE_SLICE_S))
        waited += time.perf_counter() - w0
        if woken or waited >= limit_s or q.next_is(w):
            return waited


def _leave(queue: FairQueue, w: Waiter, routed: bool) -> None:
    """Out of the queue. One that found room, or was served and leaves without using it, passes
    the turn on: there may be room for the next one too (or the room it did not take)."""
    queue.remove(w)
    if routed or (w.fut.done() and not w.fut.cancelled()):
        queue.wake()


def _uncached(ctx: RequestContext) -> int:
    """The prompt tokens a prefill engine will compute, at best (for the estimate of a queue's work)."""
    return ctx.prompt_tokens - max(ctx.cached_tokens.values(), default=0)
