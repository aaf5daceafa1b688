"""Build the Starlette app from a config: routes, and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .config import GatewayConfig
from .dispatch import Dispatcher
from .errors import APIError, error_response
from .metrics import GatewayMetrics
from .pools import HealthChecker, Pools
from .service import Gateway, build_pipeline
from .tokenizer import ModelTokenizer, Tokenizers
from .upstream import Upstream, make_session


def create_app(cfg: GatewayConfig, tokenizers: Tokenizers | None = None) -> FastPath:
    """The gateway app; ``tokenizers`` may be injected (tests), else loaded at startup."""
    created = int(time.time())
    # Built now so that a bad policy name fails before the server binds its port.
    pipeline = build_pipeline(cfg.routing)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Gateway]]:
        toks = tokenizers
        if toks is None:
            loaded = await asyncio.gather(
                *(asyncio.to_thread(ModelTokenizer.load, m) for m in cfg.models)
            )
            toks = Tokenizers(loaded, cfg.tokenizer)
        pools = Pools(cfg.pools.prefill.endpoints, cfg.pools.decode.endpoints)
        session = make_session()
        health = HealthChecker(pools, session, cfg.health)
        gw = Gateway(
            cfg, toks, pools, pipeline, Dispatcher(Upstream(session, cfg.timeouts), pools), GatewayMetrics(pools)
        )
        await health.start()
        try:
            yield {"gw": gw}
        finally:
            await health.stop()
            await session.close()
            toks.close()

    async def chat(request: Request) -> ASGIApp:
        return await request.state.gw.chat(request)

    async def completions(request: Request) -> ASGIApp:
        return await request.state.gw.completions(request)

    async def models(request: Request) -> Response:
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": "pdgate",
             "root": m.name, "parent": None, "max_model_len": m.max_model_len}
            for m in cfg.models
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        pools = request.state.gw.pools
        body = {
            "ready": pools.ready(),
            "pools": {
                name: {"healthy": sum(e.healthy for e in eps), "total": len(eps)}
                for name, eps in (("prefill", pools.prefill), ("decode", pools.decode))
            },
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics(request: Request) -> Response:
        gw = request.state.gw
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    return FastPath(app, {"/v1/chat/completions": chat, "/v1/completions": completions})


class FastPath:
    """POSTs to the two inference routes go straight to their handler, past Starlette's router and
    middleware (which wrap every ``send`` of every streamed chunk); the handlers answer their own
    errors. Everything else, lifespan included, is the Starlette app's."""

    def __init__(self, app: Starlette, routes: dict[str, Callable[[Request], Awaitable[ASGIApp]]]) -> None:
        self.app = app
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._routes.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
