"""The live planner: the engines each pool needs for the traffic this gateway has seen.

``Demand`` is a lifecycle subscriber: every answered request leaves (when, prompt tokens, output
tokens). Every ``planner.interval_s`` the ``DemandPlanner`` takes the last ``window_s`` of them
(sampled down to ``max_requests``), gives each its SLO by prompt length, and asks the planner's
analytical model (:func:`sim.planner.pool_demand`, the engine profile's costs) for the fewest
engines per pool that would serve that traffic within the SLOs. The answer is in fractions of an
engine, so the figures of several gateway replicas (or worker processes) add up: an autoscaler sums
``pdgate_pool_desired_engines{pool}`` over replicas and scales the pool to the ceiling of that.

The model runs in a thread (it is pure Python: ~0.3 s for 1,000 requests, holding the GIL in
slices), never on the event loop's own time, and never longer than ``interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from policies.base import Decision, Finished, RequestContext

from .config import GatewayConfig, PlannerConfig
from .tasks import cancel_checkpoint, stop_task

log = logging.getLogger(__name__)

MAX_SEEN = 200_000  # requests remembered, whatever the window (bounds memory at any rate)
DEFAULT_PD_THRESHOLD = 4096


class Demand:
    """What was asked of the engines: one (monotonic time, prompt tokens, output tokens) per request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_seen: int = MAX_SEEN) -> None:
        self._clock = clock
        self._started = clock()
        self._seen: deque[tuple[float, int, int]] = deque(maxlen=max_seen)

    def on_finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        if result.status == 200 and ctx.prompt_tokens:
            self._seen.append((self._clock(), ctx.prompt_tokens, result.output_tokens or 1))

    def window(self, seconds: float) -> tuple[list[tuple[float, int, int]], float]:
        """The requests of the last ``seconds`` (older ones are dropped), and the time they span:
        ``seconds``, or less while this gateway has not been up that long."""
        now = self._clock()
        while self._seen and self._seen[0][0] < now - seconds:
            self._seen.popleft()
        if len(self._seen) == self._seen.maxlen:  # a full memory: the window is what it holds
            return list(self._seen), max(now - self._seen[0][0], 1e-3)
        return list(self._seen), max(min(seconds, now - self._started), 1e-3)


@dataclass(frozen=True)
class Recommendation:
    prefill: float
    decode: float
    requests: int  # in the window
    compute_s: float
    met: bool  # False: not even the model's limit of engines meets the SLOs at this traffic


def pd_threshold(cfg: GatewayConfig, has_prefill_pool: bool) -> int | None:
    """Where the planner assumes P/D starts: planner.pd_threshold, else the router's own."""
    if not has_prefill_pool:
        return None
    if cfg.planner.pd_threshold is not None:
        return cfg.planner.pd_threshold
    decider = cfg.routing.decider
    if decider.name == "token_threshold":
        return int(decider.params.get("threshold", DEFAULT_PD_THRESHOLD))
    return DEFAULT_PD_THRESHOLD


def recommend(
    planner_cfg: PlannerConfig,
    seen: list[tuple[float, int, int]],
    span_s: float,
    threshold: int | None,
    seed: int = 0,
) -> Recommendation:
    """The planner's answer for the requests ``seen`` over ``span_s`` seconds (blocking: run it
    in a thread)."""
    from sim import planner, profile
    from sim.fleet import Job

    t0 = time.perf_counter()
    if not seen:
        return Recommendation(0.0, 0.0, 0, 0.0, True)
    keep = planner_cfg.max_requests
    sample = seen if len(seen) <= keep else random.Random(seed).sample(seen, keep)
    duration = span_s * len(sample) / len(seen)  # the sample keeps the observed rate
    jobs = []
    for t, prompt, output in sorted(sample):
        slo = next(s for s in planner_cfg.slos if s.max_prompt_tokens is None or prompt <= s.max_prompt_tokens)
        jobs.append(Job(t, prompt, output, slo.ttft_s, slo.itl_p90_s, slo.itl_p99_s))
    settings = profile.engine_settings(planner_cfg.profile, end=planner_cfg.profile_end)
    demand = planner.pool_demand(settings, jobs, duration, pd_threshold=threshold, target=planner_cfg.target,
                                 tail=planner_cfg.tail)  # fmt: skip
    took = time.perf_counter() - t0
    if demand is None:
        return Recommendation(0.0, 0.0, len(seen), took, False)
    return Recommendation(demand[0], demand[1], len(seen), took, True)


class DemandPlanner:
    """Recomputes the recommendation every ``planner.interval_s`` while the planner is enabled."""

    def __init__(self, demand: Demand, config: Callable[[], GatewayConfig], has_prefill_pool: Callable[[], bool]):
        self._demand = demand
        self._config = config
        self._has_prefill = has_prefill_pool
        self._task: asyncio.Task[None] | None = None
        self.latest: Recommendation | None = None
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdgate-planner")

    async def stop(self) -> None:
        await stop_task(self._task)

    async def run_once(self) -> Recommendation | None:
        cfg = self._config()
        if not cfg.planner.enabled:
            self.latest = None
            return None
        p = cfg.planner
        seen, span = self._demand.window(p.window_s)
        threshold = pd_threshold(cfg, self._has_prefill())
        try:
            async with asyncio.timeout(p.interval_s):
                self.latest = await asyncio.to_thread(recommend, p, seen, span, threshold)
        except Exception as err:  # a model error must not take the loop down: keep the last answer
            self.failures += 1
            log.warning("planner: no recommendation this round (%s: %s)", type(err).__name__, err)
        return self.latest

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config().planner.interval_s)
            cancel_checkpoint()
            await self.run_once()

    def exported(self) -> dict[str, Any] | None:
        """What /metrics shows (None: the planner is off or has not answered yet)."""
        rec = self.latest
        if rec is None or not self._config().planner.enabled:
            return None
        return {"prefill": rec.prefill, "decode": rec.decode, "requests": rec.requests,
                "compute_s": rec.compute_s, "unmet": 0 if rec.met else 1}  # fmt: skip
