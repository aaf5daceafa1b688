"""The load of a goodput run (:mod:`bench.goodput`): each request sent on its schedule (streaming,
with its TTFT and inter-token gaps measured in simulated time), and a progress line per point.

Scoring the results is :mod:`bench.goodput_metrics`. :mod:`bench.fairness` sends its requests
the same way.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.goodput_cluster import MODEL
from bench.workloads import Request


@dataclass
class Result:
    klass: str
    ok: bool
    ttft_s: float = 0.0  # simulated
    itls_s: list[float] = field(default_factory=list)  # simulated
    tokens: int = 0
    finished_s: float = 0.0  # simulated, since the run's start
    path: str | None = None
    error: str | None = None
    status: int = 0  # HTTP


class Progress:
    """One status line on stderr, redrawn in place."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if now - self._last > 0.25 or self.done == self.total:
            self._last = now
            self.draw()

    def draw(self, final: bool = False) -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        line = f"  {self.label:48s} [{bar}] {self.done}/{self.total}" + (
            f" ({self.failed} failed)" if self.failed else ""
        )
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif final:
            print(line, file=sys.stderr, flush=True)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    req: Request,
    t0: float,
    scale: float,
    progress: Progress,
    headers: dict[str, str] | None = None,
) -> Result:
    """One streamed completion at its arrival time: its TTFT and inter-token gaps (simulated)."""
    body = orjson.dumps(
        {
            "model": MODEL,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    delay = t0 + req.arrival_s * scale - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    res = Result(req.klass, False)
    last = 0.0
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
        ) as resp:
            res.status = resp.status
            res.path = resp.headers.get("x-pdgate-path")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if b'"error"' in line[:20] or b'"object":"error"' in line:
                    res.error = line[6:206].decode(errors="replace")
                    return res
                if b'"choices":[]' in line:
                    continue  # a usage-only chunk
                if res.tokens == 0:
                    res.ttft_s = (now - start) / scale
                else:
                    res.itls_s.append((now - last) / scale)
                last = now
                res.tokens += 1
        res.ok = res.tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except (TimeoutError, aiohttp.ClientError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.finished_s = (time.perf_counter() - t0) / scale
        progress.tick(res.ok)
    return res


async def run_point(url: str, reqs: list[Request], scale: float, progress: Progress) -> list[Result]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter() + 0.2
        return await asyncio.gather(*(send(session, url, r, t0, scale, progress) for r in reqs))
