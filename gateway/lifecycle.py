"""One lifecycle for the gateway's long-lived parts: started in order, stopped within one bound,
told of each new config version.

Two kinds of part. A **service** runs in the background (a health checker, a config watcher, a
feed): services start in the order they were added, since a later one may read what an earlier
one found (discovery before health checks), and stop all at once, each within
``gateway/background.py``'s bound, so shutdown takes one bound, never the sum. A **resource** is
something the services use (an HTTP session, the engine connections, the tokenizers' threads):
resources close after every service has stopped, in the reverse order of their adding. A start
that fails stops what had started, so a gateway that cannot start leaves nothing running.

Adding a part is one ``add`` call next to where it is built; ``create_app``'s lifespan only runs
``async with lifecycle:``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gateway.background import STOP_BOUND_S
from gateway.config import GatewayConfig

log = logging.getLogger(__name__)

Step = Callable[[], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    start: Step | None
    stop: Step | None
    configure: Callable[[GatewayConfig], Awaitable[None] | None] | None
    resource: bool
    drain: Step | None = None


async def _run(step: Callable[..., Any], *args: Any) -> None:
    result = step(*args)
    if inspect.isawaitable(result):
        await result


class Lifecycle:
    """The ordered registry of the gateway's parts (see the module docstring)."""

    def __init__(self, bound_s: float = STOP_BOUND_S) -> None:
        self._parts: list[Part] = []
        self._started: list[Part] = []
        self._bound_s = bound_s

    def add(
        self,
        name: str,
        *,
        start: Step | None = None,
        stop: Step | None = None,
        configure: Callable[[GatewayConfig], Awaitable[None] | None] | None = None,
        resource: bool = False,
        drain: Step | None = None,
    ) -> None:
        """``start``/``stop``/``configure``/``drain`` may be plain or async callables;
        ``resource``: closed after every service stopped, in reverse order (``stop`` is its close);
        ``drain``: lets work in flight finish before the stop (``Lifecycle.drain``)."""
        if any(p.name == name for p in self._parts):
            raise ValueError(f"a part named {name!r} is already registered")
        self._parts.append(Part(name, start, stop, configure, resource, drain))

    @property
    def names(self) -> list[str]:
        return [p.name for p in self._parts]

    async def start(self) -> None:
        for part in self._parts:
            try:
                if part.start is not None:
                    await _run(part.start)
            except BaseException:
                log.error("starting %s failed: stopping what had started", part.name)
                await self.stop()
                raise
            self._started.append(part)

    async def drain(self, bound_s: float) -> None:
        """Shutting down, before ``stop``: every started part with a ``drain`` lets what it has in
        flight finish (a part that serves other than over HTTP: uvicorn drains the HTTP side), all
        at once, cut at ``bound_s`` (``server.shutdown_grace_s``). A part keeps serving while it
        drains; its stop then ends what is left."""
        draining = [p for p in self._started if p.drain is not None]
        if draining:
            await asyncio.gather(*(self._drain(p, bound_s) for p in draining))

    async def _drain(self, part: Part, bound_s: float) -> None:
        assert part.drain is not None
        try:
            async with asyncio.timeout(bound_s):
                await _run(part.drain)
        except TimeoutError:
            log.warning("%s: work still in flight after %.0f s of draining; stopping it", part.name, bound_s)
        except Exception:
            log.exception("draining %s failed", part.name)

    async def stop(self) -> None:
        """Services together (each within the bound), then resources in reverse order. A part
        whose stop raises is logged; the others still stop."""
        started, self._started = self._started, []
        services = [p for p in started if not p.resource and p.stop is not None]
        await asyncio.gather(*(self._stop(p) for p in services))
        for part in reversed([p for p in started if p.resource and p.stop is not None]):
            await self._stop(part)

    async def _stop(self, part: Part) -> None:
        assert part.stop is not None
        try:
            async with asyncio.timeout(self._bound_s * 2):  # each stop is bounded itself; this is the backstop
                await _run(part.stop)
        except TimeoutError:
            log.warning("%s did not stop within %.0f s: left behind", part.name, self._bound_s * 2)
        except Exception:
            log.exception("stopping %s failed", part.name)

    async def configure(self, cfg: GatewayConfig) -> None:
        """A new config version was applied: each part that follows the config takes it, in order."""
        for part in self._parts:
            if part.configure is not None:
                await _run(part.configure, cfg)

    async def __aenter__(self) -> Lifecycle:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
