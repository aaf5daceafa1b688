"""The gateway's uvicorn server for a config: the guard (gateway/http/server.py) as its ``http``
protocol, uvloop, no WebSockets, no access log or proxy headers, and the shutdown signal the parts
that drain outside HTTP wait for (``Connections.stopping``)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, cast

import uvicorn

from gateway.config import GatewayConfig
from gateway.http.connections import Connections, Limits
from gateway.http.server import guarded_protocol


def make_server(
    cfg: GatewayConfig,
    build_app: Callable[[Connections], Any],
    *,
    host: str,
    port: int,
    log_level: str,
    max_connections: int | None = None,
) -> uvicorn.Server:
    """The uvicorn server for ``cfg``, behind the guard; ``build_app`` gets the connection count
    (for /metrics). ``max_connections``: this process's share of ``server.max_connections``."""
    cap = cfg.server.max_connections if max_connections is None else max_connections
    srv = cfg.server
    limits = Limits(
        max_head_bytes=cfg.limits.max_header_bytes,
        max_headers=cfg.limits.max_headers,
        head_timeout_s=srv.head_timeout_s,
        max_connections=cap,
        body_timeout_s=srv.body_timeout_s,
        body_idle_timeout_s=srv.body_idle_timeout_s,
        stall_timeout_s=srv.client_stall_timeout_s,
    )
    connections = Connections(limits.max_connections)
    # No proxy-headers middleware: nothing reads the client address, and it wraps every request.
    # No WebSockets (ws="none"): the gateway serves none, and uvicorn's upgrade hands the socket to
    # another protocol behind the guard's back (its connection would never leave the count).
    config = uvicorn.Config(
        build_app(connections),
        host=host,
        port=port,
        loop="uvloop",
        http=guarded_protocol(limits, connections),
        ws="none",
        access_log=False,
        proxy_headers=False,
        log_level=log_level,
        server_header=False,
        # uvicorn annotates it int, but only hands it to asyncio.wait_for: seconds, fractions work
        timeout_graceful_shutdown=cast(int, srv.shutdown_grace_s),
        timeout_keep_alive=cast(int, srv.keep_alive_timeout_s),  # the same: call_later's seconds
    )
    quiet_upgrades()

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            connections.stopping.set()
            await super().shutdown(sockets=sockets)

    return Server(config)


class _NoUpgradeWarnings(logging.Filter):
    """uvicorn logs two WARNINGs for every upgrade request it answers as plain HTTP (one of them
    advising to install a WebSocket library): a line pair any client could have written at will."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_UPGRADE_WARNINGS))


_UPGRADE_WARNINGS = ("Unsupported upgrade request", "No supported WebSocket library detected")


def quiet_upgrades() -> None:
    """Drop uvicorn's upgrade warnings (idempotent): the guard closes such connections after their
    answer, which is all there is to say."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _NoUpgradeWarnings) for f in logger.filters):
        logger.addFilter(_NoUpgradeWarnings())
