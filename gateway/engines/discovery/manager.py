"""``Discovery``: the EndpointSlice watchers of every pool with a discovery section, and the pools'
endpoints with what they found (the package's docstring says how they follow the API)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import EndpointConfig, GatewayConfig

if TYPE_CHECKING:
    from .watcher import SliceWatcher


log = logging.getLogger("gateway.engines.discovery")

POOLS = ("prefill", "decode")


class Discovery:
    """The watchers of every pool with a discovery section, and the endpoints they found.

    ``on_change`` is awaited (one call at a time, coalesced) after any pool's set changes and after
    ``configure``; it should apply ``effective(config in force)`` to the pools."""

    def __init__(self, on_change: Callable[[], Awaitable[None]]) -> None:
        self._on_change = on_change
        self.watchers: dict[str, SliceWatcher] = {}
        self._dirty = asyncio.Event()  # a change waits to be applied
        self._idle = asyncio.Event()  # every change seen so far is applied
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None

    def effective(self, cfg: GatewayConfig) -> GatewayConfig:
        """``cfg`` with each pool's endpoints = its static list + what discovery found (a URL
        listed statically keeps its static settings)."""
        update = {}
        for name in POOLS:
            watcher = self.watchers.get(name)
            pool = getattr(cfg.pools, name)
            if watcher is None or pool.discovery is None:
                continue
            static = {e.url for e in pool.endpoints}
            extra = [e for e in watcher.endpoints if e.url not in static]
            if extra:
                update[name] = pool.model_copy(update={"endpoints": [*pool.endpoints, *extra]})
        if not update:
            return cfg
        return cfg.model_copy(update={"pools": cfg.pools.model_copy(update=update)})

    async def configure(self, cfg: GatewayConfig) -> None:
        """Start, restart or stop watchers to match ``cfg``, then have the pools brought up to date."""
        if self._worker is None:
            self._worker = asyncio.create_task(self._work(), name="discovery-apply")
        for name in POOLS:
            want = getattr(cfg.pools, name).discovery
            have = self.watchers.get(name)
            if have is not None and have.cfg == want:
                continue
            carried: tuple[EndpointConfig, ...] = ()
            if have is not None:
                await have.stop()
                del self.watchers[name]
                carried = have.endpoints
            if want is not None:
                # The new watcher starts from the old one's endpoints and keeps them until its first
                # list replaces them: a reload must not empty the pool (a discovery-only decode pool
                # would answer 503, and the prefixes learned for those engines would be forgotten).
                from .watcher import SliceWatcher  # the Kubernetes client: only with discovery configured

                watcher = SliceWatcher(name, want, self._changed, carried)
                self.watchers[name] = watcher
                await watcher.start()
        self._changed()

    def _changed(self) -> None:
        self._idle.clear()
        self._dirty.set()

    async def start(self, cfg: GatewayConfig, wait_s: float = 5.0) -> None:
        """``configure``, then wait up to ``wait_s`` for every watcher's first list (so the pools
        are complete from the first request); a slow or failing API does not stop startup."""
        await self.configure(cfg)
        waits = [w.synced.wait() for w in self.watchers.values()]
        if waits:
            try:
                async with asyncio.timeout(wait_s):
                    await asyncio.gather(*waits)
            except TimeoutError:
                log.warning(
                    "discovery: the first list has not completed in %.0f s; serving with the "
                    "static endpoints until it does",
                    wait_s,
                )
            await self.settle()

    async def settle(self) -> None:
        """Return once every change seen so far has been applied."""
        await self._idle.wait()

    async def _work(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._on_change()
            except Exception:  # one bad update must not stop discovery for good (not BaseException)
                log.exception("discovery: applying discovered endpoints failed")
            if not self._dirty.is_set():
                self._idle.set()
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)

    async def close(self) -> None:
        """Stop every watcher and the worker, all at once and within one bound (gateway/background.py)."""
        watchers = list(self.watchers.values())
        self.watchers.clear()
        worker, self._worker = self._worker, None
        await asyncio.gather(*(w.stop() for w in watchers), stop_task(worker))
