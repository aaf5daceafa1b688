"""The uvicorn server built for a config (gateway/http/uvicorn_server.py): the guard with the
config's bounds, and uvicorn's upgrade warnings dropped."""

from __future__ import annotations

import logging

from gateway.config import GatewayConfig
from gateway.http.connections import Connections
from gateway.http.server import GuardedProtocol
from gateway.http.uvicorn_server import make_server, quiet_upgrades


def _cfg(**server: object) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "models": [{"name": "tiny", "tokenizer": "/t", "max_model_len": 64}],
            "pools": {"decode": {"endpoints": ["http://127.0.0.1:9"]}},
            "server": server,
            "limits": {"max_header_bytes": 2048, "max_headers": 7},
        }
    )


def test_the_guard_takes_every_connection_bound_from_the_config():
    cfg = _cfg(
        head_timeout_s=3,
        body_timeout_s=30,
        body_idle_timeout_s=4,
        client_stall_timeout_s=42,
        max_connections=99,
        keep_alive_timeout_s=2,
    )
    seen: list[Connections] = []
    server = make_server(cfg, lambda c: seen.append(c) or (lambda *a: None), host="127.0.0.1", port=0, log_level="info")
    protocol = server.config.http
    assert isinstance(protocol, type) and issubclass(protocol, GuardedProtocol)
    limits = protocol.LIMITS
    assert (limits.head_timeout_s, limits.body_timeout_s, limits.body_idle_timeout_s) == (3, 30, 4)
    assert (limits.stall_timeout_s, limits.max_connections) == (42, 99)
    assert (limits.max_head_bytes, limits.max_headers) == (2048, 7)
    assert protocol.CONNECTIONS is seen[0] and seen[0].limit == 99  # the app reports the guard's count
    assert server.config.ws == "none" and server.config.timeout_keep_alive == 2
    # a worker's share of the connection cap wins over the config's
    shared = make_server(cfg, lambda c: lambda *a: None, host="127.0.0.1", port=0, log_level="info", max_connections=33)
    assert shared.config.http.LIMITS.max_connections == 33


def test_uvicorns_upgrade_warnings_are_dropped_once_and_other_lines_kept(caplog):
    quiet_upgrades()
    quiet_upgrades()
    logger = logging.getLogger("uvicorn.error")
    assert sum(type(f).__name__ == "_NoUpgradeWarnings" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        logger.warning("Unsupported upgrade request.")
        logger.warning("No supported WebSocket library detected.")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
