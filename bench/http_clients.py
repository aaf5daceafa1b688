"""Why the gateway has its own upstream client: per-request cost of httpx, aiohttp and the two
engine transports (gateway/engines/transport.py): ``AiohttpTransport`` (the reference, aiohttp plus the
interface's timeouts and limits) and ``H1Client`` (the default).

Each client posts the same small JSON body over one keep-alive connection to a minimal local
HTTP server at concurrency 1, alternating in rounds; reported are p50/p99 latency and CPU time
per request (client and server share this process, so both columns include the server's part).

    python -m bench.http_clients [--requests 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import uvloop

from gateway.engines.h1client import H1Client
from gateway.engines.transport import EngineTransport, Timeouts
from gateway.engines.transport_aiohttp import AiohttpTransport

BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
PAYLOAD = b'{"model":"m","prompt":"hello world","max_tokens":16}'


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request with RESPONSE (enough HTTP/1.1 for a keep-alive client)."""
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(buf) < length:
                buf += await reader.read(65536)
            buf = buf[length:]
            writer.write(RESPONSE)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main(requests: int, rounds: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    url = base + "/v1/completions"
    headers = {"content-type": "application/json"}
    h1, ref = H1Client(), AiohttpTransport()
    timeouts = Timeouts(connect=5, total=60)
    async with httpx.AsyncClient() as hx, aiohttp.ClientSession() as ah:

        async def with_httpx() -> None:
            r = await hx.post(url, content=PAYLOAD, headers=headers)
            await r.aread()

        async def with_aiohttp() -> None:
            async with ah.post(url, data=PAYLOAD, headers=headers) as r:
                await r.read()

        def with_transport(client: EngineTransport) -> Callable[[], Awaitable[None]]:
            async def call() -> None:
                r = await client.post(base, "/v1/completions", PAYLOAD, headers, timeouts)
                await r.read()
                r.release()

            return call

        clients = (
            ("httpx", with_httpx),
            ("aiohttp", with_aiohttp),
            ("AiohttpTransport", with_transport(ref)),
            ("h1client", with_transport(h1)),
        )
        print("| client | round | p50 us | p99 us | CPU us/request |\n|---|---|---|---|---|")
        for rnd in range(rounds):
            for name, call in clients:
                for _ in range(200):
                    await call()
                lat, c0 = [], _cpu()
                for _ in range(requests):
                    t0 = time.perf_counter()
                    await call()
                    lat.append(time.perf_counter() - t0)
                cpu = (_cpu() - c0) / requests
                lat.sort()
                print(
                    f"| {name} | {rnd + 1} | {lat[len(lat) // 2] * 1e6:.0f} | {lat[int(len(lat) * 0.99)] * 1e6:.0f} "
                    f"| {cpu * 1e6:.0f} |"
                )
    h1.close()
    ref.close()
    await asyncio.sleep(0)  # the reference's close runs as a task
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    uvloop.run(main(args.requests, args.rounds))
    sys.exit(0)
