"""What the HTTP front counts and bounds per server: the guard's limits on one client
(``Limits``) and the open connections with the cap on them (``Connections``), which /metrics,
admission's overload signal and the shutdown of parts that drain also read."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

SMOOTHING = 0.3  # a new sample's weight: one scheduling hiccup is not an overload, a sustained wait is


@dataclass(frozen=True)
class Limits:
    max_head_bytes: int = 16384  # request line + headers
    max_headers: int = 100
    head_timeout_s: float = 10.0
    max_connections: int = 10000
    body_timeout_s: float = 60.0  # the whole body, from the end of the head
    body_idle_timeout_s: float = 15.0  # the longest gap between a body's bytes
    stall_timeout_s: float = 300.0  # the longest a client may take none of the bytes waiting for it


class Connections:
    """Open connections of one server, and the rate-limited log line when the cap is reached.

    ``wait_s``: how long new connections' first requests waited in the kernel before this process
    read them (smoothed; gateway/fairness/admission.py LoopLag decays it). A saturated uvloop accepts new
    connections late while its timers still fire on time, so this, not the timers' lateness, is
    what shows the gateway is past its capacity for new streams."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.refused = 0
        self.stalled = 0  # reset: the client took nothing for ``Limits.stall_timeout_s``
        self.wait_s = 0.0
        # set when the server begins shutting down: parts that drain other than over HTTP (the
        # endpoint picker) start then, beside the HTTP connections' grace, not after it
        self.stopping = asyncio.Event()
        self._logged = self._stall_logged = 0.0

    def waited(self, seconds: float) -> None:
        self.wait_s += (seconds - self.wait_s) * SMOOTHING

    def enter(self) -> bool:
        if self.limit and self.open >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= 10.0:
                self._logged = now
                log.warning(
                    "%d connections open, the limit (server.max_connections): refusing new ones (%d refused so far)",
                    self.open,
                    self.refused,
                )
            return False
        self.open += 1
        return True

    def stalled_out(self) -> None:
        self.stalled += 1
        now = time.monotonic()
        if now - self._stall_logged >= 10.0:
            self._stall_logged = now
            log.warning(
                "a client took none of its answer for server.client_stall_timeout_s: connection reset, its "
                "engine request aborted (%d so far)",
                self.stalled,
            )

    def leave(self) -> None:
        self.open -= 1
