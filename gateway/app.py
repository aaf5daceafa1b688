"""Build the Starlette app from a config: routes, and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from policies.blockhash import HashSpec
from policies.estimates import EngineEstimates
from policies.hooks import Hooks, policy_hooks
from policies.prefix_index import PrefixIndex
from policies.prefix_learning import InFlightPrefixes, PrefixBeliefs

from .admission import Gate, LoopLag, SharedGate
from .auth import authorize, authorize_admin
from .config import GatewayConfig, PinnedFiles, access_switched_off
from .demand import Demand, DemandPlanner
from .discovery import Discovery
from .enginestats import StatsScraper
from .errors import APIError, error_response
from .fairqueue import FairQueue
from .gcpolicy import Collector
from .httpserver import Connections
from .kvevents import KVEventSubscriber
from .kvwire import FeedLimits
from .legs import KVReleaser
from .metrics import BeliefAudit, GatewayMetrics, authorize_scrape
from .modelcheck import ServedModels
from .pools import Endpoint, HealthChecker, Pools
from .protocol import Kind
from .relay import InferenceEndpoint
from .reload import ConfigWatcher, version_of
from .requestlog import AccessLog
from .router import DEFAULT_BLOCK_SIZE, Router, build_pipeline
from .runtime import Runtime, Services
from .service import Gateway
from .state import RedisState
from .tasks import STOP_BOUND_S
from .tenants import Tenancy, Usage, label_secret
from .tokenizer import ModelTokenizer, Tokenizers
from .tracing import Tracing
from .transport import EngineTransport
from .upstream import Upstream, make_client, make_session
from .workerbus import WorkerBus
from .workers import WorkerContext

log = logging.getLogger(__name__)


def validate(cfg: GatewayConfig) -> None:
    """Everything about a config that can be checked without engines or tokenizers (used by
    ``pdgate check-config``, at startup and before a reload takes effect)."""
    build_pipeline(cfg.routing)
    Router(cfg.routing, Pools([], []), PrefixIndex())  # the prefix hashing settings
    cfg.admin_token()
    Tenancy(cfg.fairness, cfg.key_entries(), label_secret(cfg.admin))  # the keys' tenants and classes
    if cfg.state.backend == "redis":
        cfg.state.redis_url()


class Subscriptions:
    """One KV-event subscriber per endpoint whose config names a publisher."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        # (url, kv_events, kv_events_replay, kv_events_topic, hash spec, bounds): a change to any starts a new one
        self._subs: dict[tuple[str, str | None, str | None, str, HashSpec, FeedLimits, int], KVEventSubscriber] = {}
        self._lock = asyncio.Lock()  # a reload and a discovery change may update at once

    async def update(self, cfg: GatewayConfig) -> None:
        async with self._lock:
            await self._update(cfg)

    async def _update(self, cfg: GatewayConfig) -> None:
        p = cfg.routing.prefix
        spec = HashSpec(block_size=p.block_size or DEFAULT_BLOCK_SIZE, algo=p.hash_algo, seed=p.hash_seed)
        limits = FeedLimits(p.max_event_message_bytes, p.max_event_batch_blocks)
        self._index.max_precise_per_url = p.max_event_blocks  # applies from the next stored batch
        wanted = {
            (e.url, e.kv_events, e.kv_events_replay, e.kv_events_topic, spec, limits, p.max_event_blocks): e
            for pool in (cfg.pools.prefill, cfg.pools.decode) for e in pool.endpoints if e.kv_events and p.enabled
        }
        for key in [k for k in self._subs if k not in wanted]:
            await self._subs.pop(key).stop()
        for key in wanted.keys() - self._subs.keys():
            url, addr, replay, topic, _, _, max_blocks = key
            sub = KVEventSubscriber(url, addr, index=self._index, replay_endpoint=replay, topic=topic, spec=spec,
                                    limits=limits, max_translations=max_blocks)
            await sub.start()
            self._subs[key] = sub

    def all(self) -> list[KVEventSubscriber]:
        return list(self._subs.values())

    async def close(self) -> None:
        await asyncio.gather(*(sub.stop() for sub in self._subs.values()))  # each bounded; all at once
        self._subs.clear()


def create_app(cfg: GatewayConfig, tokenizers: Tokenizers | None = None, *,
               config_path: str | Path | None = None, config_version: str | None = None,
               span_exporter: SpanExporter | None = None,
               access_sink: Callable[[bytes], None] | None = None,
               connections: Connections | None = None, collector: Collector | None = None,
               worker: WorkerContext | None = None, listen: tuple[str, int] | None = None) -> Starlette:
    """The gateway app; ``tokenizers`` may be injected (tests), else loaded at startup. With
    ``config_path``, edits of that file are validated and applied while serving. ``span_exporter``
    (tests) receives every span, whatever the config's exporter; ``access_sink`` every access line
    (default: stdout); ``connections`` the HTTP server's open-connection count (for /metrics);
    ``collector`` (the process owner's) freezes what startup and each reload leave alive;
    ``worker``: this app is one of several worker processes of one gateway (gateway/workers.py);
    ``listen``: the address it serves on, when the command line overrides ``server.host``/``port``
    (the running config, /admin/config included, says it, and reloads keep it)."""
    created = int(time.time())
    if listen is not None:
        cfg = listening(cfg, *listen)
    if cfg.pinned is None:  # what it means is fixed now: its keys, token and templates as read here
        cfg = cfg.pin(PinnedFiles.read(cfg.named_files()))
    validate(cfg)  # a bad policy name fails before the server binds its port
    version = config_version or version_of(orjson.dumps(cfg.model_dump(mode="json")))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Gateway]]:
        toks = tokenizers
        if toks is None:
            loaded = await asyncio.gather(*(asyncio.to_thread(ModelTokenizer.load, cfg.tokenizer_model(m))
                                           for m in cfg.models))
            toks = Tokenizers(loaded, cfg.tokenizer)
        estimates = EngineEstimates()

        def restarted(ep: Endpoint) -> None:
            """The engine restarted: nothing learned about it holds."""
            beliefs.forget(ep.url)
            estimates.forget(ep.url)
            metrics.restarted(ep.pool)

        pools = Pools(cfg.pools.prefill.urls, cfg.pools.decode.urls, topology=cfg.pools.topology,
                      stats_max_age_s=cfg.signals.max_age_s,
                      outlier=cfg.health.outlier, prefill_speed=estimates.prefill_s_per_token, on_restart=restarted)
        index = PrefixIndex(max_approx_entries=cfg.routing.prefix.max_learned_blocks,
                            approx_ttl_s=cfg.routing.prefix.learned_ttl_s)
        usage = Usage(cfg.fairness.half_life_s, cfg.fairness.max_tenants)
        shared = (RedisState(cfg.state, cfg.routing.prefix.learned_ttl_s, pools, usage=usage)
                  if cfg.state.backend == "redis" else None)
        bus = (WorkerBus(worker.bus, worker.index, worker.count, pools, index, share_routing=shared is None,
                         usage=usage)
               if worker and worker.count > 1 else None)
        beliefs = PrefixBeliefs(index, InFlightPrefixes(), shared or (bus if bus and bus.share_routing else None),
                                caching_off=pools.caching_off)
        subs = Subscriptions(index)

        async def discovered() -> None:
            """Kubernetes discovery's endpoints changed: apply them to the pools as a reload would."""
            before = set(map(id, pools.all()))
            eff = discovery.effective(gw.runtime.cfg)
            removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls, eff.pools.topology)
            for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
                res.learners.forget(url)
            await res.subs.update(eff)
            await asyncio.gather(*(health.probe(e) for e in pools.all() if id(e) not in before))

        discovery = Discovery(discovered)
        session = make_session(cfg.engines)  # control plane: the engines' TLS settings too
        models = ServedModels(pools, session, [m.name for m in cfg.models], cfg.health.timeout_s)
        metrics = GatewayMetrics(pools, index, subs.all, shared, lambda: discovery.watchers.values(),
                                 estimates.prefill_s_per_token, models)
        engines = make_client(cfg.engines)
        res = Resources(session, engines, pools, index, shared, subs, discovery, models,
                        Learners(beliefs, estimates, BeliefAudit(metrics), Demand()), metrics)
        services = Services(pools, metrics, Tracing(cfg.telemetry.tracing, span_exporter),
                            AccessLog(cfg.telemetry.access_log, access_sink),
                            SharedGate(cfg.admission.max_in_flight, worker.slots, worker.lock, worker.index,
                                       queue=FairQueue("gateway", usage))
                            if worker and bus else Gate(cfg.admission.max_in_flight, FairQueue("gateway", usage)),
                            KVReleaser(Upstream(engines, cfg.timeouts)), LoopLag(connections=connections), usage)
        pools.release_listeners.append(services.queues.released)
        scraper = StatsScraper(pools, session, cfg.signals)
        metrics.watch_admission(services.gate, connections, services.lag)
        metrics.watch_tenants(usage, services.tenant_labels, services.queues.queued)

        async def engine_up(ep: Endpoint, recovering: bool) -> None:
            """Before routing sees an engine (again): the same run? what does it serve?"""
            if recovering:
                await scraper.recovered(ep)
            await models.check(ep)

        health = HealthChecker(pools, session, cfg.health, on_up=engine_up)
        metrics.config_loaded(version)

        async def apply(new: GatewayConfig, new_version: str) -> None:
            await _apply(gw, listening(new, *listen) if listen else new, new_version, res,
                         worker.applied if worker is not None else None)
            health.configure(new.health)
            scraper.configure(new.signals)
            if collector:
                collector.settle_later()

        def reload_result(result: str, message: str) -> None:
            metrics.reloads.labels(result).inc()
            if result == "ok":
                metrics.config_loaded(message)

        speaks = worker is None or worker.index == 0  # one worker logs a rejected edit for the gateway
        watcher = ConfigWatcher(config_path, version, apply, reload_result, speaks=speaks) if config_path else None
        gw = Gateway(_runtime(cfg, version, res, toks, cfg.admin_token()), services, watcher=watcher,
                     feeds=res.subs.all, shared=shared, discovery=discovery, models=models, bus=bus,
                     health=health)
        services.configure(cfg.fairness, gw.runtime.tenancy.names)
        def prefill_pool_configured() -> bool:  # not "has endpoints now": a pool scaled to 0 still counts
            prefill = gw.runtime.cfg.pools.prefill
            return bool(prefill.urls or prefill.discovery)

        planner = DemandPlanner(res.learners.demand, lambda: gw.runtime.cfg, prefill_pool_configured)
        metrics.watch_planner(planner.exported)
        if bus:
            metrics.watch_bus(bus)
            await bus.start(metrics.render)
        await res.subs.update(cfg)
        if shared:
            await shared.start()
        await discovery.start(cfg)
        await health.start()
        scraper.start()
        services.lag.start()
        planner.start()
        if watcher:
            watcher.start()
        if collector:
            collector.tune()
            collector.settle()
        try:
            yield {"gw": gw}
        finally:
            if collector:
                collector.close()
            # Every background part stops at once, each within gateway/tasks.py's bound: shutdown
            # takes at most one bound, never the sum, and never hangs.
            await asyncio.gather(*(stop() for stop in (
                *((watcher.stop,) if watcher else ()), scraper.stop, discovery.close, health.stop, res.subs.close,
                *((shared.stop,) if shared else ()), *((bus.stop,) if bus else ()), services.releaser.close,
                planner.stop)),
                return_exceptions=True)
            services.gate.close()
            await services.lag.stop()
            await session.close()
            engines.close()
            gw.runtime.tokenizers.close()
            try:  # flushing spans may block on the exporter
                async with asyncio.timeout(STOP_BOUND_S):
                    await asyncio.to_thread(services.tracing.shutdown)
            except TimeoutError:
                log.warning("tracing: spans not flushed within %.0f s at shutdown", STOP_BOUND_S)
            services.access_log.close()

    async def models_route(request: Request) -> Response:
        gw: Gateway = request.state.gw
        rt = gw.runtime
        try:
            authorize(request, rt.api_keys, rt.cfg.limits.max_header_bytes)
        except APIError as err:
            return error_response(err)
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": "pdgate",
             "root": m.name, "parent": None, "max_model_len": m.max_model_len}
            for m in rt.cfg.models
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
            "last_reload_error": gw.watcher.last_error if gw.watcher else None,
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

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    app = GatewayApp(inference, routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    # No trailing-slash redirects: Starlette builds them from the request's Host header, which the
    # client chooses (POST /v1/chat/completions/ with Host: evil.example would redirect there).
    app.router.redirect_slashes = False
    return app


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


@dataclass(frozen=True)
class Learners:
    """The gateway's own lifecycle subscribers; they outlive config versions with what they learned."""

    beliefs: PrefixBeliefs  # what each engine holds in its prefix cache
    estimates: EngineEstimates  # prefill speeds and P/D hand-over times
    audit: BeliefAudit  # how far routing's beliefs are from what the engines report
    demand: Demand  # what the traffic asks of the engines (the live planner's input)

    def subscribers(self) -> list[tuple[str, object]]:
        return [("prefix_beliefs", self.beliefs), ("engine_estimates", self.estimates),
                ("belief_audit", self.audit), ("demand", self.demand)]

    def forget(self, url: str) -> None:
        """``url`` left the configuration."""
        self.beliefs.index.forget(url)
        self.beliefs.in_flight.forget(url)
        self.estimates.forget(url)


@dataclass(frozen=True)
class Resources:
    """What outlives config versions: connections, endpoint state, the prefix index, event feeds."""

    session: aiohttp.ClientSession  # control plane: health checks, metrics scrapes, model lists
    engines: EngineTransport  # the engine legs: warm keep-alive connections survive reloads
    pools: Pools
    index: PrefixIndex
    shared: RedisState | None
    subs: Subscriptions
    discovery: Discovery | None  # engines found through the Kubernetes API
    models: ServedModels
    learners: Learners
    metrics: GatewayMetrics


def _runtime(cfg: GatewayConfig, version: str, res: Resources, tokenizers: Tokenizers,
             admin: str | None) -> Runtime:
    learners = res.learners
    router = Router(cfg.routing, res.pools, res.index, res.shared, learners.beliefs.in_flight, learners.estimates)
    hooks = Hooks([*learners.subscribers(), *policy_hooks(router.pipeline.members())], res.metrics.hook_failed)
    keys = cfg.key_entries()
    return Runtime(cfg, version, router, Upstream(res.engines, cfg.timeouts), tokenizers, hooks,
                   tuple(k.key.encode() for k in keys), admin, Tenancy(cfg.fairness, keys, label_secret(cfg.admin)))


def _shown(value: Any) -> str:
    """A config value for a log line: set or unset, never what it holds (file and variable names
    only)."""
    return "unset" if value in (None, "", [], {}) else repr(value)


def listening(cfg: GatewayConfig, host: str, port: int) -> GatewayConfig:
    """``cfg`` with the address the server listens on (``pdgate serve --host/--port`` win over the file)."""
    if (cfg.server.host, cfg.server.port) == (host, port):
        return cfg
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"host": host, "port": port})})


# Sections bound to the process (listening socket, shared-state connection): a reload keeps the
# running values and says so.
RESTART_ONLY = ("server", "state", "telemetry", "engines")


async def _apply(gw: Gateway, new: GatewayConfig, version: str, res: Resources,
                 applied: Callable[[GatewayConfig, str], None] | None = None) -> None:
    """Validate everything first, then swap: a reload that fails at any step changes nothing.
    ``applied`` hears of the swap at once (a worker's supervisor: a worker it starts from then on
    starts from this config)."""
    old = gw.runtime
    pools = res.pools
    validate(new)
    token = new.admin_token()
    switched_off = access_switched_off(old.cfg, new)  # raises for what an edit would switch off unsaid
    keys = tuple(k.key.encode() for k in new.key_entries())
    for section in ("auth", "admin"):  # who may call the gateway: never changed quietly
        before, after = getattr(old.cfg, section), getattr(new, section)
        changed = [f"{k}: {_shown(getattr(before, k))} -> {_shown(getattr(after, k))}"
                   for k in type(after).model_fields if getattr(before, k) != getattr(after, k)]
        if section == "auth" and keys != old.api_keys:  # the keys file's content too (names only, never keys)
            changed.append(f"API keys: {len(old.api_keys)} -> {len(keys)} ({len(set(old.api_keys) - set(keys))} "
                           f"removed, {len(set(keys) - set(old.api_keys))} added)")
        if section == "admin" and token != old.admin_token and not changed:
            changed.append("the admin token (its file's content)")
        if changed:
            log.warning("config reload changes %s: %s", section, ", ".join(changed))
    if switched_off:  # said on purpose (auth.disabled / admin.disabled); still, loudly
        log.error("config reload switches authentication OFF on purpose: %s no longer apply%s", " and ".join(
            switched_off), " (access is now open: anyone who reaches the port may call the API)"
            if not keys else "")
    for section in RESTART_ONLY:
        if getattr(new, section) != getattr(old.cfg, section):
            log.warning("config reload: the %s section changed; it takes effect at the next restart", section)
            new = new.model_copy(update={section: getattr(old.cfg, section)})
    tokenizers = old.tokenizers
    if (new.models != old.cfg.models or new.tokenizer != old.cfg.tokenizer  # or a template file's text:
            or list(map(new.tokenizer_model, new.models)) != list(map(old.cfg.tokenizer_model, old.cfg.models))):
        try:
            loaded = await asyncio.gather(*(
                asyncio.to_thread(ModelTokenizer.load, m) if (t := old.tokenizers.get(m.name)) is None or t.cfg != m
                else asyncio.sleep(0, t) for m in map(new.tokenizer_model, new.models)  # a template file's text
            ))
        except Exception as err:  # a missing or broken tokenizer: keep serving the old config
            raise ValueError(f"models: cannot load a tokenizer ({type(err).__name__}: {err})") from None
        tokenizers = Tokenizers(loaded, new.tokenizer)
    runtime = _runtime(new, version, res, tokenizers, token)
    # Nothing below can fail: the new config is applied whole.
    eff = res.discovery.effective(new) if res.discovery else new  # static + discovered endpoints
    removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls, eff.pools.topology)
    pools.configure(new.signals.max_age_s, new.health.outlier)
    for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
        res.learners.forget(url)
    gw.runtime = runtime
    if applied is not None:
        applied(new, version)
    gw.services.gate.limit = new.admission.max_in_flight
    gw.services.configure(new.fairness, runtime.tenancy.names)
    res.models.configure([m.name for m in new.models], new.health.timeout_s)
    await res.subs.update(eff)
    if res.discovery:
        await res.discovery.configure(new)
    if tokenizers is not old.tokenizers:
        old.tokenizers.close(cancel=False)  # requests still tokenizing there finish first
    await res.models.check_all()
