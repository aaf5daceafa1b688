"""Admission control: how much the gateway takes on before it makes clients wait, then says no.

Two bounds, both optional (0 = none):

- requests in flight through the gateway overall (``max_in_flight``): a request beyond it waits
  in a queue for a slot (FIFO, or by priority and tenant: gateway/fairness/fairqueue.py);
- requests in flight per engine (``max_per_decode_endpoint``, ``max_per_prefill_endpoint``,
  counting other replicas' requests when state is shared): a saturated engine is not chosen; with
  every healthy decode engine saturated the request waits for one to free up. A saturated prefill
  pool sends P/D requests direct instead (reason ``no_prefill_endpoint``).

A request waits at most ``queue_timeout_s`` in all, then gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Protocol

from gateway.config import AdmissionConfig
from gateway.fairness.fairqueue import FairQueue
from gateway.fairness.tenants import Identity, Usage
from gateway.http.errors import APIError


def too_busy(cfg: AdmissionConfig, what: str) -> APIError:
    return APIError(
        429,
        f"The gateway is at capacity ({what}); retry after {cfg.retry_after_s:g} s.",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(math.ceil(cfg.retry_after_s))},
    )


class Gate:
    """A semaphore with a bounded wait; ``limit`` 0 admits everyone. Waiters are served in the
    ``queue``'s order (FIFO, or fair across tenants). Slots are counted here (``_take``/``_give_back``);
    ``SharedGate`` counts them for several worker processes."""

    def __init__(self, limit: int, queue: FairQueue | None = None) -> None:
        self.limit = limit
        self._held = 0
        self._waiters = queue if queue is not None else FairQueue("gateway", Usage())

    @property
    def in_flight(self) -> int:
        return self._held

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def queue(self) -> FairQueue:
        return self._waiters

    def _take(self) -> bool:
        if self.limit and self._held >= self.limit:
            return False
        self._held += 1
        return True

    def _give_back(self) -> None:
        self._held -= 1

    def _queued(self) -> None:
        """A request joined the queue (``SharedGate`` starts looking for other workers' slots)."""

    async def enter(self, timeout: float, who: Identity | None = None) -> bool:
        """True once admitted; False if no slot came within ``timeout`` seconds. Raises QueueFull."""
        if (not self.limit or not self._waiters) and self._take():
            return True
        w = self._waiters.join(who)
        self._queued()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the client's cancel
            return await self._waiters.wait(w, timeout)  # True: leave() handed its slot over
        except asyncio.CancelledError:  # the client left while queued
            if w.fut.done() and not w.fut.cancelled():
                self.leave()  # pass on the slot it was handed
            raise
        finally:
            if not w.fut.done():
                w.fut.cancel()
            self._waiters.remove(w)

    def leave(self) -> None:
        w = self._waiters.pop_best()
        if w is not None:
            w.fut.set_result(None)  # the slot passes on; in_flight stays
            return
        self._give_back()

    def close(self) -> None:
        """Nothing runs in the background (``SharedGate``'s poller does)."""


class Slots(Protocol):
    """Admission slots held per worker process, in memory every worker of one gateway shares
    (``multiprocessing`` RawArray) behind one lock."""

    def __getitem__(self, i: int) -> int: ...

    def __setitem__(self, i: int, v: int) -> None: ...

    def __len__(self) -> int: ...


class Lock(Protocol):
    def acquire(self, block: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...


class SharedGate(Gate):
    """``Gate`` for a gateway of several worker processes: ``limit`` bounds the sum of every
    worker's slots. A worker takes a slot under the shared lock (a few microseconds, never
    contended for long); its own queue keeps its order, and while requests wait it looks for a slot
    another worker freed every ``poll_s`` (workers do not wake each other)."""

    def __init__(
        self, limit: int, slots: Slots, lock: Lock, worker: int, poll_s: float = 0.002, queue: FairQueue | None = None
    ) -> None:
        super().__init__(limit, queue)
        self._slots, self._lock, self._me = slots, lock, worker
        self._poll_s = poll_s
        self._poller: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        """This worker's slots (``/metrics`` sums the workers')."""
        return self._slots[self._me]

    def _take(self) -> bool:
        if not self.limit:  # nothing to bound: only this worker writes its own cell, no lock needed
            self._slots[self._me] += 1
            return True
        if not self._lock.acquire(True, 0.1):  # held by a worker that died mid-update: the supervisor frees it
            return False
        try:
            if sum(self._slots[i] for i in range(len(self._slots))) >= self.limit:
                return False
            self._slots[self._me] += 1
            return True
        finally:
            self._lock.release()

    def _give_back(self) -> None:
        if self.limit and self._lock.acquire(True, 0.1):
            try:
                self._slots[self._me] -= 1
            finally:
                self._lock.release()
        else:
            self._slots[self._me] -= 1  # this worker's own cell: only it writes there

    def _queued(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="admission-poll")

    async def _poll(self) -> None:
        """Slots other workers freed, for this worker's waiters; ends when nobody waits."""
        while self._waiters:
            await asyncio.sleep(self._poll_s)
            while self._waiters and self._take():
                w = self._waiters.pop_best()
                if w is None:
                    self._give_back()
                else:
                    w.fut.set_result(None)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


SMOOTHING = 0.3  # a new sample's weight in the smoothed lateness
SHED_AT_ONCE = 5  # this many times the bound late: shed without waiting out the hold


class Waits(Protocol):
    wait_s: float


class LoopLag:
    """How late this process serves: a timer every ``interval_s`` notes how much later than asked
    it fired, and the HTTP server notes how long new connections' requests waited in the kernel
    before they were read (``connections``: httpserver.Connections). Past a bound, a new request
    would only add to the delay every stream already sees, so admission answers 429 instead: the
    capacity it protects is measured live, on whatever machine the gateway runs.

    A burst (thousands of streams opening within a second or two) makes the loop late for as long
    as it takes to open them, then the streams run within capacity: shedding then would refuse
    streams a proxy with a queue serves. So the delay must stay past the bound for ``hold_s``
    (``admission.overload_hold_s``) before new requests are refused: a burst the gateway absorbs
    is served, a load it cannot carry is still shed, and a delay ``SHED_AT_ONCE`` times the bound
    is shed at once."""

    def __init__(
        self,
        interval_s: float = 0.01,
        connections: Waits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._connections = connections
        self._clock = clock
        self.lag_s = 0.0  # smoothed (one late tick is a hiccup, many are an overload)
        self.peak_s = 0.0  # the largest single delay seen (for /metrics)
        self._bound_s = 0.0  # the bound last asked about (admission's config)
        self._above_since: float | None = None  # since when the delay has stayed past it
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval_s)
            self.note(loop.time() - asked - self.interval_s)

    def note(self, late_s: float) -> None:
        late_s = max(0.0, late_s)
        self.peak_s = max(self.peak_s, late_s)
        self.lag_s += (late_s - self.lag_s) * SMOOTHING
        if self._connections is not None:  # no new connection for a tick: their wait fades too
            self._connections.wait_s /= 2
        self._track()

    def _track(self) -> None:
        if self._bound_s > 0 and self.behind_s > self._bound_s:
            if self._above_since is None:
                self._above_since = self._clock()
        else:
            self._above_since = None

    @property
    def behind_s(self) -> float:
        """The worse of the two delays."""
        return max(self.lag_s, self._connections.wait_s if self._connections is not None else 0.0)

    def over(self, bound_ms: float, hold_s: float = 0.0) -> bool:
        """Whether new requests should be refused: later than ``bound_ms`` for ``hold_s`` now."""
        if bound_ms <= 0:
            return False
        self._bound_s = bound_ms / 1000
        behind = self.behind_s
        if behind <= self._bound_s:
            return False
        if behind > self._bound_s * SHED_AT_ONCE:
            return True
        self._track()
        since = self._above_since
        return since is not None and self._clock() - since >= hold_s

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
