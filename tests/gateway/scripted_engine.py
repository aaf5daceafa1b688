"""A scripted stand-in for an engine on loopback: answers what the test queues and records every
request. For tests of the gateway's own logic, where the simulator's realism is not the point."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.procs import free_port


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class ScriptedEngine:
    port: int = field(default_factory=free_port)
    requests: list[Recorded] = field(default_factory=list)
    _queue: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reply(self, path: str, body: Any = None, status: int = 200, raw: bytes | None = None) -> None:
        """Queue one answer for the next POST to ``path``."""
        self._queue[path].append((status, raw if raw is not None else orjson.dumps(body)))

    def reset(self) -> None:
        self.requests.clear()
        self._queue.clear()

    def posts(self, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.path == path]

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append(Recorded(request.path, headers, orjson.loads(raw)))
        if not self._queue[request.path]:
            return web.json_response({"error": {"message": "nothing scripted"}}, status=599)
        status, body = self._queue[request.path].popleft()
        return web.Response(body=body, status=status, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    def start(self) -> ScriptedEngine:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            app = web.Application()
            app.router.add_get("/health", self._health)
            app.router.add_post("/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
