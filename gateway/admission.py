"""Admission control: how much the gateway takes on before it makes clients wait, then says no.

Two bounds, both optional (0 = none):

- requests in flight through the gateway overall (``max_in_flight``): a request beyond it waits
  in a FIFO queue for a slot;
- requests in flight per engine (``max_per_decode_endpoint``, ``max_per_prefill_endpoint``,
  counting other replicas' requests when state is shared): a saturated engine is not chosen; with
  every healthy decode engine saturated the request waits for one to free up. A saturated prefill
  pool sends P/D requests direct instead (reason ``no_prefill_endpoint``).

A request waits at most ``queue_timeout_s`` in all, then gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import collections
import math

from .config import AdmissionConfig
from .errors import APIError


def too_busy(cfg: AdmissionConfig, what: str) -> APIError:
    return APIError(
        429, f"The gateway is at capacity ({what}); retry after {cfg.retry_after_s:g} s.",
        code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(cfg.retry_after_s))},
    )


class Gate:
    """A FIFO semaphore with a bounded wait; ``limit`` 0 admits everyone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def enter(self, timeout: float) -> bool:
        """True once admitted; False if no slot came within ``timeout`` seconds."""
        if not self.limit or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the client's cancel
            async with asyncio.timeout(timeout):
                await asyncio.shield(fut)
            return True  # leave() handed its slot over: in_flight already counts us
        except TimeoutError:
            return fut.done()  # a slot that arrived as the wait ended is kept
        except asyncio.CancelledError:  # the client left while queued
            if fut.done() and not fut.cancelled():
                self.leave()  # pass on the slot it was handed
            raise
        finally:
            if not fut.done():
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    def leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; in_flight stays
                return
        self.in_flight -= 1
