"""The live planner: the engines each pool needs for the traffic this gateway has seen.

``Demand`` is a lifecycle subscriber: every answered request leaves (when, prompt tokens, output
tokens). Every ``planner.interval_s`` the ``DemandPlanner`` takes the last ``window_s`` of them
(sampled down to ``max_requests``), gives each its SLO by prompt length, and asks the planner's
analytical model (:func:`engine_model.planner.pool_demand`, the engine profile's costs) for the fewest
engines per pool that would serve that traffic within the SLOs. The answer is in fractions of an
engine, so the figures of several gateway replicas (or worker processes) add up: an autoscaler sums
``pdgate_pool_desired_engines{pool}`` over replicas and scales the pool to the ceiling of that.

The model runs on a thread of its own (pure Python: ~0.7 s for 1,000 requests, holding the GIL in
slices), one round at a time: a round still running when the next is due is not doubled, it is
told to stop at its deadline (``interval_s``), and at shutdown at once. Requests that no number of
engines would serve within their SLO (a prompt whose prefill alone is longer than its TTFT) are
counted apart; when no answer is possible the last one stays published, never 0.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import GatewayConfig, PlannerConfig
from policies.base import Decision, Finished, RequestContext

log = logging.getLogger(__name__)

MAX_SEEN = 200_000  # requests remembered, whatever the window (bounds memory at any rate)
DEFAULT_PD_THRESHOLD = 4096


class Demand:
    """What was asked of the engines: one (monotonic time, prompt tokens, output tokens) per request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_seen: int = MAX_SEEN) -> None:
        self._clock = clock
        self._started = clock()
        self._seen: deque[tuple[float, int, int]] = deque(maxlen=max_seen)
        self.active = True  # False while the planner is off: nothing is kept

    def on_finished(self, ctx: RequestContext, decision: Decision, result: Finished) -> None:
        if self.active and result.status == 200 and ctx.prompt_tokens and not result.continuation:
            self._seen.append((self._clock(), ctx.prompt_tokens, result.output_tokens or 1))

    def pause(self) -> None:
        """The planner is off: forget what was kept and keep nothing until it is on again."""
        if self.active:
            self.active = False
            self._seen.clear()

    def resume(self) -> None:
        if not self.active:
            self.active = True
            self._started = self._clock()

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
    prefill: float | None  # None: no answer this round (the last one stays published)
    decode: float | None
    requests: int  # in the window
    compute_s: float
    met: bool  # False: not even the model's limit of engines meets the SLOs at this traffic
    unservable: int = 0  # requests no number of engines serves within their SLO


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
    settings: dict[str, Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> Recommendation:
    """The planner's answer for the requests ``seen`` over ``span_s`` seconds (blocking: run it
    in a thread). ``settings``: the profile, loaded once per config version by the caller;
    ``stop``: polled between the model's steps, to end a round early."""
    from engine_model import planner, profile
    from engine_model.fleet import Job

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
    if settings is None:
        settings = profile.engine_settings(planner_cfg.profile, end=planner_cfg.profile_end)
    demand = planner.pool_demand(settings, jobs, duration, pd_threshold=threshold, target=planner_cfg.target,
                                 tail=planner_cfg.tail, stop=stop)  # fmt: skip
    took = time.perf_counter() - t0
    if demand is None:
        return Recommendation(None, None, len(seen), took, False)
    scale = len(seen) / len(sample)  # unservable requests counted in the whole window
    return Recommendation(demand.prefill, demand.decode, len(seen), took, demand.unservable == 0,
                          round(demand.unservable * scale))  # fmt: skip


class DemandPlanner:
    """Recomputes the recommendation every ``planner.interval_s`` while the planner is enabled."""

    def __init__(self, demand: Demand, config: Callable[[], GatewayConfig], has_prefill_pool: Callable[[], bool]):
        self._demand = demand
        self._config = config
        self._has_prefill = has_prefill_pool
        self._task: asyncio.Task[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdgate-planner")
        self._busy: asyncio.Future[Recommendation] | None = None  # the round on the thread, if any
        self._stopping = threading.Event()
        self._profile: tuple[PlannerConfig, dict[str, Any]] | None = None
        self.latest: Recommendation | None = None  # the last answer with figures
        self.last: Recommendation | None = None  # the last round's outcome
        self.failures = 0
        if not config().planner.enabled:
            demand.pause()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdgate-planner")

    async def stop(self) -> None:
        self._stopping.set()  # a round on the thread ends at its next step
        await stop_task(self._task)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _settings(self, p: PlannerConfig) -> dict[str, Any]:
        """The profile, read once per config version (the config check already loaded it)."""
        from engine_model import profile

        if self._profile is None or self._profile[0] is not p:
            self._profile = (p, profile.engine_settings(p.profile, end=p.profile_end))
        return self._profile[1]

    async def run_once(self) -> Recommendation | None:
        cfg = self._config()
        p = cfg.planner
        if not p.enabled:
            self._demand.pause()
            self.latest = self.last = None
            return None
        self._demand.resume()
        if self._busy is not None and not self._busy.done():
            return self.latest  # the previous round is still on the thread: not a second one
        seen, span = self._demand.window(p.window_s)
        threshold = pd_threshold(cfg, self._has_prefill())
        deadline = time.monotonic() + p.interval_s

        def stop() -> bool:
            return self._stopping.is_set() or time.monotonic() > deadline

        try:
            settings = self._settings(p)
            loop = asyncio.get_running_loop()
            self._busy = loop.run_in_executor(self._pool, lambda: recommend(p, seen, span, threshold,
                                                                            settings=settings, stop=stop))  # fmt: skip
            rec = await asyncio.shield(self._busy)
        except Exception as err:  # a model error (or a round past its deadline) keeps the last answer
            self.failures += 1
            log.warning("planner: no recommendation this round (%s: %s)", type(err).__name__, err)
            return self.latest
        self.last = rec
        if rec.prefill is not None:
            self.latest = rec
        return self.latest

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config().planner.interval_s)
            cancel_checkpoint()
            await self.run_once()

    def exported(self) -> dict[str, Any] | None:
        """What /metrics shows (None: the planner is off or has not answered yet)."""
        rec, last = self.latest, self.last
        if rec is None or last is None or not self._config().planner.enabled:
            return None
        return {"prefill": rec.prefill, "decode": rec.decode, "requests": last.requests,
                "compute_s": last.compute_s, "unmet": 0 if last.met else 1, "unservable": last.unservable,
                "failures": self.failures}  # fmt: skip
