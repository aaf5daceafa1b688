"""The picker's gRPC listener as a part of the gateway's lifecycle (gateway/lifecycle.py).

Added by the assembly when ``epp.enabled`` (``pdgate epp``): it starts after every other part
(routing needs the pools, the beliefs and the tokenizers in place) and stops first, within the
lifecycle's bound; held requests are released on the way out.
"""

from __future__ import annotations

import asyncio
import logging
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


class PickerServer:
    """ext_proc, the access log service and health on ``epp.host:epp.port``."""

    def __init__(self, gw: Gateway) -> None:
        self._gw = gw
        epp = gw.runtime.cfg.epp
        self.host, self.port = epp.host, epp.port
        self.completions = Completions(epp.completion_timeout_s)
        self._server: Server | None = None
        # several pickers sharing state on Redis pass each other the entries Envoy sent the wrong one
        self.sharing = SharedEndings(gw.runtime.cfg.state, self.completions) if gw.services.shared else None
        self._collector = PickerCollector(self.completions, self.sharing)
        self._registry = gw.services.metrics.registry
        self._registry.register(self._collector)

    def _gateway(self) -> Gateway:
        return self._gw

    async def start(self) -> None:
        services: list[IServable] = [
            ExternalProcessor(self._gateway, self.completions),
            AccessLogService(self.completions),
            Health(self._gateway),
        ]
        if self.sharing is not None:
            await self.sharing.start()
        server = Server(services)
        await server.start(self.host, self.port)
        self._server = server
        log.info("endpoint picker listening on %s:%d (ext_proc, access log, health)", self.host, self.port)

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
