"""The cyclic garbage collector, kept out of the request path's tail.

A full collection walks every object the collector tracks: with tokenizers, chat templates, the
config and the libraries loaded that is ~100k+ objects and tens of milliseconds during which every
request in flight waits (the c=32 p99 tail). What is alive once the gateway has started, or has
applied a reload, lives until the next reload; so it is collected once and moved out of the
collector's sight (``gc.freeze``). Later collections walk only what requests and the learned
indexes add. A frozen object that becomes garbage is still freed by reference counting; only
cycles among frozen objects wait for the next settle, which unfreezes and collects them.

The process owner (``pdgate serve``) makes one and hands it to the app; in-process tests pass none
and keep the interpreter's defaults.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger(__name__)


class Collector:
    """``young``: allocations between young-generation collections (the interpreter's default
    is 700: one per few requests); ``settle_after_s``: the wait after a reload before the new
    config's objects are frozen (requests on the old config finish first, so its objects are
    garbage by then, not frozen)."""

    def __init__(self, young: int = 700, settle_after_s: float = 30.0) -> None:
        self.young = young
        self.settle_after_s = settle_after_s
        self.frozen = 0  # objects frozen at the last settle
        self.settle_ms = 0.0  # what the last settle cost (one full collection)
        self._timer: asyncio.TimerHandle | None = None

    def tune(self) -> None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(self.young, older, oldest)

    def settle(self) -> None:
        """Collect everything once, then freeze what survived."""
        self._timer = None
        start = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.settle_ms = (time.perf_counter() - start) * 1000
        log.debug("gc: %d objects frozen (%.1f ms)", self.frozen, self.settle_ms)

    def settle_later(self) -> None:
        """After a reload: settle once requests on the old config are likely done."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.settle_after_s, self.settle)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
