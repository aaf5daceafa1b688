"""Build the Starlette app from a config: routes, and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from policies.blockhash import HashSpec
from policies.prefix_index import PrefixIndex

from .config import AdminConfig, GatewayConfig
from .discovery import Discovery
from .dispatch import Dispatcher
from .enginestats import StatsScraper
from .errors import APIError, error_response
from .h1client import H1Client
from .kvevents import KVEventSubscriber
from .metrics import GatewayMetrics
from .pools import HealthChecker, Pools
from .reload import ConfigWatcher, version_of
from .requestlog import AccessLog
from .router import DEFAULT_BLOCK_SIZE, Router, build_pipeline
from .service import Gateway, Runtime
from .state import RedisState
from .tokenizer import ModelTokenizer, Tokenizers
from .tracing import Tracing
from .upstream import Upstream, make_client, make_session

log = logging.getLogger(__name__)


def admin_token(cfg: AdminConfig) -> str | None:
    """The admin bearer token, or None: admin and debug endpoints are off."""
    if cfg.token_file:
        try:
            token = Path(cfg.token_file).read_text().strip()
        except OSError as err:
            raise ValueError(f"admin.token_file: cannot read ({err.strerror})") from None
        return token or None
    if cfg.token_env:
        return os.environ.get(cfg.token_env, "").strip() or None
    return None


def validate(cfg: GatewayConfig) -> None:
    """Everything about a config that can be checked without engines or tokenizers (used by
    ``pdgate check-config``, at startup and before a reload takes effect)."""
    build_pipeline(cfg.routing)
    Router(cfg.routing, Pools([], []), PrefixIndex())  # the prefix hashing settings
    admin_token(cfg.admin)
    cfg.auth.api_keys()
    if cfg.state.backend == "redis":
        cfg.state.redis_url()


class Subscriptions:
    """One KV-event subscriber per endpoint whose config names a publisher."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._subs: dict[tuple, KVEventSubscriber] = {}
        self._lock = asyncio.Lock()  # a reload and a discovery change may update at once

    async def update(self, cfg: GatewayConfig) -> None:
        async with self._lock:
            await self._update(cfg)

    async def _update(self, cfg: GatewayConfig) -> None:
        p = cfg.routing.prefix
        spec = HashSpec(block_size=p.block_size or DEFAULT_BLOCK_SIZE, algo=p.hash_algo, seed=p.hash_seed)
        wanted = {
            (e.url, e.kv_events, e.kv_events_replay, e.kv_events_topic, spec): e
            for pool in (cfg.pools.prefill, cfg.pools.decode) for e in pool.endpoints if e.kv_events and p.enabled
        }
        for key in [k for k in self._subs if k not in wanted]:
            await self._subs.pop(key).stop()
        for key in wanted.keys() - self._subs.keys():
            url, addr, replay, topic, _ = key
            sub = KVEventSubscriber(url, addr, index=self._index, replay_endpoint=replay, topic=topic, spec=spec)
            await sub.start()
            self._subs[key] = sub

    def all(self) -> list[KVEventSubscriber]:
        return list(self._subs.values())

    async def close(self) -> None:
        for sub in self._subs.values():
            await sub.stop()
        self._subs.clear()


def create_app(cfg: GatewayConfig, tokenizers: Tokenizers | None = None, *,
               config_path: str | Path | None = None, config_version: str | None = None,
               span_exporter: SpanExporter | None = None,
               access_sink: Callable[[bytes], None] | None = None) -> FastPath:
    """The gateway app; ``tokenizers`` may be injected (tests), else loaded at startup. With
    ``config_path``, edits of that file are validated and applied while serving. ``span_exporter``
    (tests) receives every span, whatever the config's exporter; ``access_sink`` every access line
    (default: stdout)."""
    created = int(time.time())
    validate(cfg)  # a bad policy name fails before the server binds its port
    version = config_version or version_of(orjson.dumps(cfg.model_dump(mode="json")))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Gateway]]:
        toks = tokenizers
        if toks is None:
            loaded = await asyncio.gather(*(asyncio.to_thread(ModelTokenizer.load, m) for m in cfg.models))
            toks = Tokenizers(loaded, cfg.tokenizer)
        pools = Pools(cfg.pools.prefill.urls, cfg.pools.decode.urls, stats_max_age_s=cfg.signals.max_age_s,
                      outlier=cfg.health.outlier)
        index = PrefixIndex(max_approx_entries=cfg.routing.prefix.max_learned_blocks,
                            approx_ttl_s=cfg.routing.prefix.learned_ttl_s)
        shared = (RedisState(cfg.state, cfg.routing.prefix.learned_ttl_s, pools)
                  if cfg.state.backend == "redis" else None)
        subs = Subscriptions(index)

        async def discovered() -> None:
            """Kubernetes discovery's endpoints changed: apply them to the pools as a reload would."""
            before = set(map(id, pools.all()))
            eff = discovery.effective(gw.runtime.cfg)
            removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls)
            for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
                index.forget(url)
            await res.subs.update(eff)
            await asyncio.gather(*(health.probe(e) for e in pools.all() if id(e) not in before))

        discovery = Discovery(discovered)
        metrics = GatewayMetrics(pools, index, subs.all, shared, lambda: discovery.watchers.values())
        res = Resources(make_session(), make_client(), pools, index, shared, subs,
                        metrics.failover, discovery)
        tracing = Tracing(cfg.telemetry.tracing, span_exporter)
        gw = Gateway(_runtime(cfg, version, res, toks), pools, metrics, tracing,
                     AccessLog(cfg.telemetry.access_log, access_sink))
        gw.admin_token = admin_token(cfg.admin)
        health = HealthChecker(pools, res.session, cfg.health)
        scraper = StatsScraper(pools, res.session, cfg.signals)
        metrics.config_loaded(version)

        async def apply(new: GatewayConfig, new_version: str) -> None:
            await _apply(gw, new, new_version, res)
            health.configure(new.health)
            scraper.configure(new.signals)

        def reload_result(result: str, message: str) -> None:
            metrics.reloads.labels(result).inc()
            if result == "ok":
                metrics.config_loaded(message)

        watcher = ConfigWatcher(config_path, version, apply, reload_result) if config_path else None
        gw.watcher = watcher
        gw.feeds = res.subs.all
        gw.discovery = discovery
        gw.shared = shared
        await res.subs.update(cfg)
        if shared:
            await shared.start()
        await discovery.start(cfg)
        await health.start()
        scraper.start()
        if watcher:
            watcher.start()
        try:
            yield {"gw": gw}
        finally:
            if watcher:
                await watcher.stop()
            await scraper.stop()
            await discovery.close()
            await health.stop()
            await res.subs.close()
            if shared:
                await shared.stop()
            await res.session.close()
            res.engines.close()
            gw.runtime.tokenizers.close()
            await asyncio.to_thread(tracing.shutdown)  # flushing spans may block on the exporter
            gw.access_log.close()

    async def chat(request: Request) -> ASGIApp:
        return await request.state.gw.chat(request)

    async def completions(request: Request) -> ASGIApp:
        return await request.state.gw.completions(request)

    async def models(request: Request) -> Response:
        try:
            request.state.gw.authorize(request)
        except APIError as err:
            return error_response(err)
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": "pdgate",
             "root": m.name, "parent": None, "max_model_len": m.max_model_len}
            for m in request.state.gw.runtime.cfg.models
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        gw = request.state.gw
        pools = gw.pools
        body = {
            "ready": pools.ready(),
            "pools": {
                name: {"healthy": sum(e.healthy for e in eps), "ejected": sum(e.ejected for e in eps),
                       "total": len(eps)}
                for name, eps in (("prefill", pools.prefill), ("decode", pools.decode))
            },
            "kv_event_feeds": {"connected": sum(f.counters.connected for f in gw.feeds()),
                               "total": len(gw.feeds())},
            "shared_state": ({"backend": "redis", "healthy": gw.shared.status.healthy,
                              "error": gw.shared.status.last_error or None}
                             if gw.shared else {"backend": "memory", "healthy": True}),
        }
        if gw.discovery is not None and gw.discovery.watchers:  # pools that follow EndpointSlices
            body["discovery"] = {
                w.pool: {"synced": w.synced.is_set(), "endpoints": len(w.endpoints), "errors": w.errors,
                         "last_error": w.last_error or None}
                for w in gw.discovery.watchers.values()
            }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics(request: Request) -> Response:
        gw = request.state.gw
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    def admin(handler: Callable[[Gateway, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Off (404) unless an admin token is configured; then the bearer token must match."""

        async def guarded(request: Request) -> Response:
            gw: Gateway = request.state.gw
            if gw.admin_token is None:
                return error_response(APIError(404, f"{request.method} {request.url.path}: Not Found"))
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), gw.admin_token.encode()):
                return error_response(APIError(401, "A valid admin bearer token is required.",
                                               type_="authentication_error", code="invalid_admin_token"))
            try:
                return await handler(gw, request)
            except APIError as err:
                return error_response(err)

        return guarded

    async def admin_config(gw: Gateway, request: Request) -> Response:
        rt = gw.runtime
        body = {
            "version": rt.version,
            "source": str(config_path) if config_path else None,
            "last_reload_error": gw.watcher.last_error if gw.watcher else None,
            "config": rt.cfg.model_dump(mode="json"),
        }
        return Response(orjson.dumps(body), media_type="application/json")

    async def debug_route(gw: Gateway, request: Request) -> Response:
        return Response(orjson.dumps(await gw.explain(request)), media_type="application/json")

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/config", admin(admin_config), methods=["GET"]),
        Route("/debug/route", admin(debug_route), methods=["POST"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    return FastPath(app, {"/v1/chat/completions": chat, "/v1/completions": completions})


@dataclass(frozen=True)
class Resources:
    """What outlives config versions: connections, endpoint state, the prefix index, event feeds."""

    session: aiohttp.ClientSession  # control plane: health checks, metrics scrapes
    engines: H1Client  # the engine legs: warm keep-alive connections survive reloads
    pools: Pools
    index: PrefixIndex
    shared: RedisState | None
    subs: Subscriptions
    on_failover: Callable[[str, str], None]  # (event, cause): metrics
    discovery: Discovery | None = None  # engines found through the Kubernetes API


def _runtime(cfg: GatewayConfig, version: str, res: Resources, tokenizers: Tokenizers) -> Runtime:
    return Runtime(cfg, version, Router(cfg.routing, res.pools, res.index, res.shared),
                   Dispatcher(Upstream(res.engines, cfg.timeouts), res.pools, cfg.timeouts, cfg.failover,
                              res.on_failover), tokenizers,
                   tuple(k.encode() for k in cfg.auth.api_keys()))


# Sections bound to the process (listening socket, shared-state connection): a reload keeps the
# running values and says so.
RESTART_ONLY = ("server", "state", "telemetry")


async def _apply(gw: Gateway, new: GatewayConfig, version: str, res: Resources) -> None:
    """Validate everything first, then swap: a reload that fails at any step changes nothing."""
    old = gw.runtime
    pools, index = res.pools, res.index
    validate(new)
    token = admin_token(new.admin)
    for section in RESTART_ONLY:
        if getattr(new, section) != getattr(old.cfg, section):
            log.warning("config reload: the %s section changed; it takes effect at the next restart", section)
            new = new.model_copy(update={section: getattr(old.cfg, section)})
    tokenizers = old.tokenizers
    if new.models != old.cfg.models or new.tokenizer != old.cfg.tokenizer:
        try:
            loaded = await asyncio.gather(*(
                asyncio.to_thread(ModelTokenizer.load, m) if (t := old.tokenizers.get(m.name)) is None or t.cfg != m
                else asyncio.sleep(0, t) for m in new.models
            ))
        except Exception as err:  # a missing or broken tokenizer: keep serving the old config
            raise ValueError(f"models: cannot load a tokenizer ({type(err).__name__}: {err})") from None
        tokenizers = Tokenizers(loaded, new.tokenizer)
    # Built against the live pools, so it must come after their update; nothing below can fail.
    eff = res.discovery.effective(new) if res.discovery else new  # static + discovered endpoints
    removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls)
    pools.configure(new.signals.max_age_s, new.health.outlier)
    for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
        index.forget(url)
    gw.runtime = _runtime(new, version, res, tokenizers)
    gw.gate.limit = new.admission.max_in_flight
    gw.admin_token = token
    await res.subs.update(eff)
    if res.discovery:
        await res.discovery.configure(new)
    if tokenizers is not old.tokenizers:
        old.tokenizers.close(cancel=False)  # requests still tokenizing there finish first


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
