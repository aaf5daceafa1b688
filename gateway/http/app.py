"""The Starlette app: its routes and the lifespan that runs the assembled gateway
(gateway/http/assembly.py) for as long as the server serves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.cluster.workers import WorkerContext
from gateway.config import GatewayConfig, PinnedFiles
from gateway.config.reload import version_of
from gateway.http.assembly import Options, assemble
from gateway.http.auth import authorize, authorize_admin
from gateway.http.connections import Connections
from gateway.http.errors import APIError, error_response
from gateway.http.handlers import Gateway
from gateway.http.reconfigure import listening, validate
from gateway.lifecycle import Lifecycle
from gateway.ops.gcpolicy import Collector
from gateway.ops.metrics import authorize_scrape
from gateway.request.protocol import Kind
from gateway.request.relay import InferenceEndpoint
from gateway.tokenization.tokenizer import Tokenizers


def create_app(
    cfg: GatewayConfig,
    tokenizers: Tokenizers | None = None,
    *,
    config_path: str | Path | None = None,
    config_version: str | None = None,
    span_exporter: SpanExporter | None = None,
    access_sink: Callable[[bytes], None] | None = None,
    connections: Connections | None = None,
    collector: Collector | None = None,
    worker: WorkerContext | None = None,
    listen: tuple[str, int] | None = None,
) -> Starlette:
    """The gateway app; ``tokenizers`` may be injected (tests), else loaded at startup. With
    ``config_path``, edits of that file are validated and applied while serving. ``span_exporter``
    (tests) receives every span, whatever the config's exporter; ``access_sink`` every access line
    (default: stdout); ``connections`` the HTTP server's open-connection count (for /metrics);
    ``collector`` (the process owner's) freezes what startup and each reload leave alive;
    ``worker``: this app is one of several worker processes of one gateway (gateway/cluster/workers.py);
    ``listen``: the address it serves on, when the command line overrides ``server.host``/``port``
    (the running config, /admin/config included, says it, and reloads keep it)."""
    if listen is not None:
        cfg = listening(cfg, *listen)
    if cfg.pinned is None:  # what it means is fixed now: its keys, token and templates as read here
        cfg = cfg.pin(PinnedFiles.read(cfg.named_files()))
    validate(cfg)  # a bad policy name fails before the server binds its port
    version = config_version or version_of(orjson.dumps(cfg.model_dump(mode="json")))
    opts = Options(config_path, span_exporter, access_sink, connections, collector, worker, listen)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Gateway]]:
        assembled = await assemble(cfg, version, tokenizers, opts)
        async with assembled.lifecycle:
            # The parts' drain starts when the server begins shutting down, beside uvicorn's grace
            # for the HTTP connections: one grace period in all, not one after the other.
            stopping = connections.stopping if connections is not None else asyncio.Event()
            grace = assembled.gateway.runtime.cfg.server.shutdown_grace_s
            drained = asyncio.create_task(_drain_once(stopping, assembled.lifecycle, grace))
            try:
                yield {"gw": assembled.gateway}
                stopping.set()  # a lifespan ended without the server's shutdown (an embedding app)
                await drained
            finally:
                drained.cancel()

    inference, routes = _routes(config_path, created=int(time.time()))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    app = GatewayApp(inference, routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    # No trailing-slash redirects: Starlette builds them from the request's Host header, which the
    # client chooses (POST /v1/chat/completions/ with Host: evil.example would redirect there).
    app.router.redirect_slashes = False
    return app


async def _drain_once(stopping: asyncio.Event, lifecycle: Lifecycle, grace_s: float) -> None:
    await stopping.wait()
    await lifecycle.drain(grace_s)


def _routes(config_path: str | Path | None, created: int) -> tuple[dict[str, InferenceEndpoint], list[Route]]:
    """Every route; the handlers find the gateway in ``request.state.gw`` (the lifespan's state)."""

    async def models_route(request: Request) -> Response:
        gw: Gateway = request.state.gw
        rt = gw.runtime
        try:
            authorize(request, rt.api_keys, rt.cfg.limits.max_header_bytes)
        except APIError as err:
            return error_response(err)
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "pdgate",
                "root": m.name,
                "parent": None,
                "max_model_len": m.max_model_len,
            }
            for m in rt.cfg.models
        ]
        data += [  # as vLLM lists them: the path they load from as root, the base model as parent
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "pdgate",
                "root": a.path,
                "parent": a.base,
                "max_model_len": None,
            }
            for a in (rt.adapters.all() if rt.adapters is not None else ())
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def health_route(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        body = await request.state.gw.ready_now()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics_route(request: Request) -> Response:
        gw: Gateway = request.state.gw
        try:
            authorize_scrape(request, gw.runtime.cfg.admin.protect_metrics, gw.runtime.admin_token)
        except APIError as err:
            return error_response(err)
        return Response(await gw.metrics(), media_type=gw.services.metrics.content_type)

    def admin(handler: Callable[[Gateway, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Off (404) unless an admin token is configured; then the bearer token must match."""

        async def guarded(request: Request) -> Response:
            gw: Gateway = request.state.gw
            token = gw.runtime.admin_token
            if token is None:
                return error_response(APIError(404, f"{request.method} {request.url.path}: Not Found"))
            try:
                authorize_admin(request, token)
                return await handler(gw, request)
            except APIError as err:
                return error_response(err)
            except ClientDisconnect:  # gone while its body was read: nobody to answer
                return Response(status_code=499)

        return guarded

    async def admin_config(gw: Gateway, request: Request) -> Response:
        rt = gw.runtime
        body = {
            "version": rt.version,
            "source": str(config_path) if config_path else None,
            "last_reload_error": gw.services.watcher.last_error if gw.services.watcher else None,
            "config": redacted(rt.cfg.model_dump(mode="json")),
        }
        return Response(orjson.dumps(body), media_type="application/json")

    async def debug_route(gw: Gateway, request: Request) -> Response:
        return Response(orjson.dumps(await gw.explain(request)), media_type="application/json")

    kinds: tuple[tuple[Kind, str], ...] = (("chat", "/v1/chat/completions"), ("completion", "/v1/completions"))
    inference = {path: InferenceEndpoint(kind, path) for kind, path in kinds}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in inference.items()),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/health", health_route, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/admin/config", admin(admin_config), methods=["GET"]),
        Route("/debug/route", admin(debug_route), methods=["POST"]),
    ]
    return inference, routes


_SECRET_KEYS = ("headers",)  # header values (e.g. an OTLP Authorization header) are credentials


def redacted(value: Any, key: str = "") -> Any:
    """A config dump safe to show: header values and URL passwords replaced."""
    if isinstance(value, dict):
        if key in _SECRET_KEYS:
            return {k: "<redacted>" for k in value}
        return {k: redacted(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v, key) for v in value]
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        if parts.password:
            host = parts.hostname or ""
            netloc = f"{parts.username or ''}:<redacted>@{host}" + (f":{parts.port}" if parts.port else "")
            return urlunsplit(parts._replace(netloc=netloc))
    return value


class GatewayApp(Starlette):
    """The Starlette app, whose route table holds every route, the inference ones included. While
    no middleware was added to it, a POST to an inference route goes straight to its endpoint:
    Starlette's error and exception layers wrap every ``send`` of every streamed chunk (~30 us per
    16-chunk stream and ~15 us per whole answer, docs/benchmarks.md), and the endpoint answers its
    own errors. Once middleware is added (``add_middleware``), every request takes the full stack,
    so the middleware sees inference traffic (tests/gateway/test_component.py)."""

    def __init__(self, inference: dict[str, InferenceEndpoint], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._inference = inference

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.user_middleware and scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._inference.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
