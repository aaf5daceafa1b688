"""The suite's one way to wait for something: poll a condition until it holds or a timeout passes.
Tests wait on what they need to see (a counter, a state, a log line), never for a fixed time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is truthy (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


async def until(
    predicate: Callable[[], Any | Awaitable[Any]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` (sync or async) on the event loop until it is truthy; AssertionError
    after ``timeout`` seconds. ``interval`` 0 polls on every loop turn."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        await asyncio.sleep(interval)
