"""An asyncio event loop on a virtual clock: simulated time jumps to the next timer instead of
waiting for it, so an in-process fleet of simulated engines runs as fast as the CPU allows.

Built only from public extension points: ``asyncio.SelectorEventLoop(selector)`` with a selector
whose ``select(timeout)`` polls without blocking and, when nothing is ready, advances the clock
by ``timeout``; and ``loop.time()``, which timers and ``asyncio.sleep`` read. Real I/O still works
(it is polled), but a loop that waits on I/O alone would spin: the fleet does no I/O.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (the simulation is stuck)")
        self._clock.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` is simulated seconds since the loop was made."""

    def __init__(self) -> None:
        self._virtual = _Clock()
        super().__init__(selector=_JumpingSelector(self._virtual))

    def time(self) -> float:
        return self._virtual.now


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh virtual clock (the loop is closed afterwards)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
