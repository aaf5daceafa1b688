"""The picker's gRPC listener as a part of the gateway's lifecycle (gateway/lifecycle.py).

Added by the assembly when ``epp.enabled`` (``pdgate epp``): it starts after every other part
(routing needs the pools, the beliefs and the tokenizers in place). On SIGTERM it drains first
(``drain``, within ``server.shutdown_grace_s``): health turns NOT_SERVING so Envoy sends new
requests to other pickers, picks still come and are answered, and the drain ends once no request
is being read or picked (a prefill leg included), Envoy has reported every request held, and no new
request has come for ``QUIET_S``. Only then does the
listener close, which cancels whatever the grace period cut short; held requests left are released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from grpclib.server import Server

from gateway.background import STOP_BOUND_S
from gateway.epp.completions import Completions
from gateway.epp.metrics import PickerCollector
from gateway.epp.service import AccessLogService, ExternalProcessor, Health
from gateway.epp.sharing import SharedEndings

if TYPE_CHECKING:
    from grpclib._typing import IServable  # the services' interface, for the annotation only

    from gateway.http.handlers import Gateway

log = logging.getLogger(__name__)

# A drain ends only once no ext_proc stream has begun for this long: while Envoy still sends new
# requests here (its health check has not yet seen NOT_SERVING), closing would fail them.
QUIET_S = 2.0


class PickerServer:
    """ext_proc, the access log service and health on ``epp.host:epp.port``."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        epp = gw.runtime.cfg.epp
        self.host, self.port = epp.host, epp.port
        self.completions = Completions(epp.completion_timeout_s)
        self._server: Server | None = None
        self._ext = ExternalProcessor(self._gateway, self.completions)
        self.draining = False
        # several pickers sharing state on Redis pass each other the entries Envoy sent the wrong one
        self.sharing = SharedEndings(gw.runtime.cfg.state, self.completions) if gw.services.shared else None
        self._collector = PickerCollector(self.completions, self.sharing)
        self._registry = gw.services.metrics.registry
        self._registry.register(self._collector)

    def _gateway(self) -> Gateway:
        return self._gw

    async def start(self) -> None:
        services: list[IServable] = [
            self._ext,
            AccessLogService(self.completions),
            Health(self._gateway, lambda: self.draining),
        ]
        if self.sharing is not None:
            await self.sharing.start()
        server = Server(services)
        await server.start(self.host, self.port)
        self._server = server
        log.info("endpoint picker listening on %s:%d (ext_proc, access log, health)", self.host, self.port)

    async def drain(self) -> None:
        """Not ready from now on; returns once no pick is under way and nothing is held (the
        lifecycle cuts it at ``server.shutdown_grace_s``)."""
        self.draining = True
        log.info(
            "endpoint picker draining: %d picks under way, %d requests held", self._ext.picking, len(self.completions)
        )
        # polled: counts that change at many points, checked 20 times a second while stopping only
        while self._ext.picking or len(self.completions) or self._recent_stream():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        log.info("endpoint picker drained")

    def _recent_stream(self) -> bool:
        """A stream began less than ``QUIET_S`` ago: Envoy has not yet turned to the other pickers."""
        return time.monotonic() - self._ext.last_stream_at < QUIET_S

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            try:
                async with asyncio.timeout(STOP_BOUND_S):
                    await server.wait_closed()
            except TimeoutError:
                log.warning("endpoint picker: streams still open after %.0f s; left behind", STOP_BOUND_S)
        if self.sharing is not None:
            await self.sharing.stop(bound_s=1.0)
        self.completions.close()
        self._registry.unregister(self._collector)
