"""Run the gateway app on one of several ASGI servers, for the overhead benchmark's comparison.

    python -m bench.servers SERVER CONFIG

SERVER: ``uvicorn-httptools`` (uvicorn's httptools protocol), ``uvicorn-h11`` (uvicorn's h11
protocol, which bounds request heads), ``hypercorn`` (h11), ``granian`` (Rust, hyper). The config's
``server.host``/``port`` are used. hypercorn and granian come from the ``bench`` extra.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from gateway.config import load_config

SERVERS = ("uvicorn-httptools", "uvicorn-h11", "hypercorn", "granian")


def factory() -> Any:
    """The app, from the config named by ``PDGATE_CONFIG`` (granian imports its target in workers)."""
    from gateway.http.app import create_app

    path = os.environ["PDGATE_CONFIG"]
    return create_app(load_config(path), config_path=path)


def main(argv: list[str] | None = None) -> int:
    server, path = (argv if argv is not None else sys.argv[1:])[:2]
    cfg = load_config(path)
    os.environ["PDGATE_CONFIG"] = str(Path(path).resolve())
    host, port = cfg.server.host, cfg.server.port
    if server.startswith("uvicorn"):
        import uvicorn

        uvicorn.run(
            factory(),
            host=host,
            port=port,
            loop="uvloop",
            access_log=False,
            log_level="warning",
            http="httptools" if server == "uvicorn-httptools" else "h11",
            server_header=False,
        )
    elif server == "hypercorn":
        import uvloop
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        hc = Config()
        hc.bind = [f"{host}:{port}"]
        hc.loglevel = "WARNING"
        uvloop.run(serve(factory(), hc))  # type: ignore[arg-type]
    elif server == "granian":
        from granian import Granian
        from granian.constants import Interfaces, Loops

        Granian(
            "bench.servers:factory",
            address=host,
            port=port,
            interface=Interfaces.ASGI,
            factory=True,
            loop=Loops.uvloop,
            log_level="warning",
        ).serve()  # type: ignore[arg-type]
    else:
        raise SystemExit(f"unknown server {server!r} (one of {', '.join(SERVERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
