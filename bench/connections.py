"""What a connection costs the HTTP server: plain uvicorn (httptools) against the gateway's guard.

A rush of streams opens thousands of connections at once, and a request refused under overload
pays for its connection the same way: CPU per connection is part of what a worker can take.
One trivial ASGI app (a 2-byte answer, no gateway logic) is served by uvicorn's httptools protocol
alone and behind ``gateway.http.server``'s guard, each in a process of its own; an aiohttp client
sends N requests, each on a new connection and then all on kept-alive ones, and the server's CPU
time (/proc) per request is reported, alternated over rounds.

    python -m bench.connections [--requests 3000] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.overhead import cpu_split
from tests.procs import free_port

SERVERS = ("uvicorn", "guard")
ROOT = Path(__file__).resolve().parents[1]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(server: str, port: int) -> None:
    """One server process: ``uvicorn`` (its httptools protocol) or ``guard`` (the gateway's)."""
    import uvicorn

    from gateway.http.connections import Connections
    from gateway.http.server import Limits, guarded_protocol

    http: Any = "httptools" if server == "uvicorn" else guarded_protocol(Limits(), Connections(0))
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http=http,
        ws="none",
        lifespan="off",
        access_log=False,
        log_level="warning",
        server_header=False,
    )
    uvicorn.Server(config).run()


async def _load(url: str, n: int, *, new_connections: bool, concurrency: int = 16) -> int:
    ok = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=new_connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        todo = iter(range(n))

        async def worker() -> None:
            nonlocal ok
            for _ in todo:
                async with session.get(url) as resp:
                    await resp.read()
                    ok += resp.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if asyncio.run(_load(url, 1, new_connections=True, concurrency=1)) == 1:
                return
        except aiohttp.ClientError:
            time.sleep(0.1)
    raise SystemExit("the server did not answer in time")


def measure(requests: int, rounds: int) -> dict[str, list[float]]:
    """CPU us per request, per ``server/new`` and ``server/kept`` cell, one value per round."""
    cells: dict[str, list[float]] = {}
    for _ in range(rounds):
        for server in SERVERS:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "bench.connections", "serve", server, str(port)], cwd=ROOT)
            try:
                url = f"http://127.0.0.1:{port}/"
                _wait_up(url, proc)
                asyncio.run(_load(url, min(200, requests), new_connections=True))  # warm
                for new in (True, False):
                    before = sum(cpu_split(proc.pid))
                    ok = asyncio.run(_load(url, requests, new_connections=new))
                    spent = sum(cpu_split(proc.pid)) - before
                    if ok != requests:
                        raise SystemExit(f"{server}: {requests - ok} requests failed")
                    cells.setdefault(f"{server}/{'new' if new else 'kept'}", []).append(1e6 * spent / requests)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    return cells


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1], int(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="per cell and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/connections.json")
    args = parser.parse_args(argv)
    cells = measure(args.requests, args.rounds)
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "requests": args.requests,
        "rounds": args.rounds,
        "cpu_us_per_request": cells,
        "median": {k: round(_median(v), 1) for k, v in cells.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("| server | new connection each, CPU us/request | kept alive |")
    print("|---|---|---|")
    for server in SERVERS:
        new, kept = report["median"][f"{server}/new"], report["median"][f"{server}/kept"]
        print(f"| {server} | {new} | {kept} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
