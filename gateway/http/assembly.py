"""The gateway put together from a config: every long-lived part built, wired to the parts it
reads, and registered in one ``Lifecycle`` (gateway/lifecycle.py) in the order it starts.

``create_app``'s lifespan runs ``assemble`` and then ``async with assembled.lifecycle``; a part is
added here, next to where it is built, with its start, stop and reconfigure steps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from opentelemetry.sdk.trace.export import SpanExporter

from gateway.adapters.loader import AdapterLoader
from gateway.background import STOP_BOUND_S
from gateway.cluster.redis_state import RedisState
from gateway.cluster.workerbus import WorkerBus
from gateway.cluster.workers import WorkerContext
from gateway.config import GatewayConfig
from gateway.config.reload import ConfigWatcher
from gateway.context import Learners, Runtime, Services
from gateway.engines.discovery import Discovery
from gateway.engines.enginestats import StatsScraper
from gateway.engines.legs import KVReleaser
from gateway.engines.modelcheck import ServedModels
from gateway.engines.pools import Endpoint, HealthChecker, Pools
from gateway.engines.subscriptions import Subscriptions
from gateway.engines.transport import EngineTransport
from gateway.engines.upstream import Upstream, make_client, make_session
from gateway.fairness.admission import Gate, LoopLag, SharedGate
from gateway.fairness.fairqueue import FairQueue
from gateway.fairness.tenants import Usage
from gateway.http.connections import Connections
from gateway.http.handlers import Gateway
from gateway.http.reconfigure import apply_config, listening
from gateway.lifecycle import Lifecycle
from gateway.ops.gcpolicy import Collector
from gateway.ops.live_planner import Demand, DemandPlanner
from gateway.ops.metrics import BeliefAudit, GatewayMetrics
from gateway.ops.requestlog import AccessLog
from gateway.ops.tracing import Tracing
from gateway.tokenization.tokenizer import ModelTokenizer, Tokenizers
from policies.beliefs.blockhash import DEFAULT_BLOCK_SIZE
from policies.beliefs.estimates import EngineEstimates
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import InFlightPrefixes, PrefixBeliefs
from policies.beliefs.tier_audit import TierCounterCheck
from policies.beliefs.tiers import TierBeliefs, TierIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assembled:
    gateway: Gateway  # what the routes serve with
    lifecycle: Lifecycle  # every part, in the order it starts


@dataclass(frozen=True)
class Options:
    """What the process owner adds to a config (see ``create_app``)."""

    config_path: str | Path | None = None
    span_exporter: SpanExporter | None = None
    access_sink: Callable[[bytes], None] | None = None
    connections: Connections | None = None
    collector: Collector | None = None
    worker: WorkerContext | None = None
    listen: tuple[str, int] | None = None


async def assemble(cfg: GatewayConfig, version: str, tokenizers: Tokenizers | None, opts: Options) -> Assembled:
    worker = opts.worker
    if tokenizers is None:
        loaded = await asyncio.gather(
            *(asyncio.to_thread(ModelTokenizer.load, cfg.tokenizer_model(m)) for m in cfg.models)
        )
        tokenizers = Tokenizers(loaded, cfg.tokenizer)
    life = Lifecycle()
    estimates = EngineEstimates()

    def restarted(ep: Endpoint) -> None:
        """The engine restarted: nothing learned about it holds (its L1 with it; the shared L2 stays)."""
        beliefs.forget(ep.url)
        estimates.forget(ep.url)
        tiers.forget(ep.url)
        metrics.restarted(ep.pool)

    pools = Pools(
        cfg.pools.prefill.urls,
        cfg.pools.decode.urls,
        topology=cfg.pools.topology,
        stats_max_age_s=cfg.signals.max_age_s,
        outlier=cfg.health.outlier,
        prefill_speed=estimates.prefill_s_per_token,
        on_restart=restarted,
    )
    tiers = _tier_index(cfg, pools)
    index = PrefixIndex(
        max_approx_entries=cfg.routing.prefix.max_learned_blocks,
        approx_ttl_s=cfg.routing.prefix.learned_ttl_s,
        capacity=pools.gpu_blocks,  # what an engine can hold bounds what it is believed to hold
        on_evict=tiers.demote,  # dropped for room: down to the engine's L1, when it has one
    )
    usage = Usage(cfg.fairness.half_life_s, cfg.fairness.max_tenants)
    shared = (
        RedisState(cfg.state, cfg.routing.prefix.learned_ttl_s, pools, usage=usage)
        if cfg.state.backend == "redis"
        else None
    )
    bus = (
        WorkerBus(worker.bus, worker.index, worker.count, pools, index, share_routing=shared is None, usage=usage)
        if worker and worker.count > 1
        else None
    )
    beliefs = PrefixBeliefs(
        index, InFlightPrefixes(), shared or (bus if bus and bus.share_routing else None), caching_off=pools.caching_off
    )
    subs = Subscriptions(index, tiers)

    async def discovered() -> None:
        """Kubernetes discovery's endpoints changed: apply them to the pools as a reload would."""
        before = set(map(id, pools.all()))
        eff = discovery.effective(gw.runtime.cfg)
        removed = pools.update(eff.pools.prefill.urls, eff.pools.decode.urls, eff.pools.topology)
        for url in {ep.url for ep in removed} - {ep.url for ep in pools.all()}:
            services.forget(url)
        await subs.update(eff)
        await asyncio.gather(*(health.probe(e) for e in pools.all() if id(e) not in before))

    discovery = Discovery(discovered)
    session = make_session(cfg.engines)  # control plane: the engines' TLS settings too
    models = ServedModels(pools, session, [m.name for m in cfg.models], cfg.health.timeout_s)
    models.refresh_s = cfg.lora.refresh_s
    metrics = GatewayMetrics(
        pools, index, subs.all, shared, lambda: discovery.watchers.values(), estimates.prefill_s_per_token, models
    )
    engines = make_client(cfg.engines)
    counters = _counter_check(cfg, tiers)
    learners = Learners(beliefs, estimates, BeliefAudit(metrics), Demand(), TierBeliefs(tiers), counters)
    pools.report_listeners.append(
        lambda ep, st, restarted: counters.on_counters(ep.url, st.cached_by_source, restarted=restarted)
    )
    metrics.watch_tier_counters(counters, pools)
    gate = (
        SharedGate(
            cfg.admission.max_in_flight, worker.slots, worker.lock, worker.index, queue=FairQueue("gateway", usage)
        )
        if worker and bus
        else Gate(cfg.admission.max_in_flight, FairQueue("gateway", usage))
    )
    scraper = StatsScraper(pools, session, cfg.signals)

    async def engine_up(ep: Endpoint, recovering: bool) -> None:
        """Before routing sees an engine (again): the same run? what does it serve?"""
        if recovering:
            await scraper.recovered(ep)
        await models.check(ep)

    health = HealthChecker(pools, session, cfg.health, on_up=engine_up)

    async def apply(new: GatewayConfig, new_version: str) -> None:
        await apply_config(
            gw,
            listening(new, *opts.listen) if opts.listen else new,
            new_version,
            worker.applied if worker is not None else None,
        )
        await life.configure(new)

    def reload_result(result: str, message: str) -> None:
        metrics.reloads.labels(result).inc()
        if result == "ok":
            metrics.config_loaded(message)

    speaks = worker is None or worker.index == 0  # one worker logs a rejected edit for the gateway
    watcher = (
        ConfigWatcher(opts.config_path, version, apply, reload_result, speaks=speaks) if opts.config_path else None
    )
    services = Services(
        pools,
        metrics,
        Tracing(cfg.telemetry.tracing, opts.span_exporter),
        AccessLog(cfg.telemetry.access_log, opts.access_sink),
        gate,
        KVReleaser(Upstream(engines, cfg.timeouts)),
        LoopLag(connections=opts.connections),
        usage,
        index=index,
        learners=learners,
        engines=engines,
        session=session,
        subs=subs,
        models=models,
        loader=AdapterLoader(pools, session, cfg.lora),
        health=health,
        shared=shared,
        discovery=discovery,
        bus=bus,
        watcher=watcher,
    )
    pools.release_listeners.append(services.queues.released)
    metrics.watch_admission(services.gate, opts.connections, services.lag)
    if services.loader is not None:
        metrics.watch_adapter_loads(services.loader)
    metrics.watch_tenants(usage, services.tenant_labels, services.queues.queued)
    metrics.config_loaded(version)
    gw = Gateway(Runtime.build(cfg, version, services, tokenizers, cfg.admin_token()), services)
    services.configure(cfg.fairness, gw.runtime.tenancy.names)

    def prefill_pool_configured() -> bool:  # not "has endpoints now": a pool scaled to 0 still counts
        prefill = gw.runtime.cfg.pools.prefill
        return bool(prefill.urls or prefill.discovery)

    planner = DemandPlanner(learners.demand, lambda: gw.runtime.cfg, prefill_pool_configured)
    metrics.watch_planner(planner.exported)

    parts = _Parts(subs, discovery, health, scraper, planner, engines, session, bus, shared, watcher)
    _register(life, gw, parts, opts.collector, cfg)
    return Assembled(gw, life)


def _tier_index(cfg: GatewayConfig, pools: Pools) -> TierIndex:
    """The tier beliefs, sized by the config in force (``configure_tiers`` on reload): L1 by
    ``routing.tiers.l1_blocks``, else each engine's reported ``num_cpu_blocks``."""
    tiers = TierIndex(ttl_s=cfg.routing.prefix.learned_ttl_s)
    configure_tiers(tiers, cfg, pools)
    return tiers


def _counter_check(cfg: GatewayConfig, tiers: TierIndex) -> TierCounterCheck:
    counters = TierCounterCheck(tiers)
    configure_counter_check(counters, cfg)
    return counters


def configure_counter_check(counters: TierCounterCheck, cfg: GatewayConfig) -> None:
    """Off (or tiers off): nothing is judged, and what was distrusted is trusted again."""
    c = cfg.routing.tiers.counter_check
    on = cfg.routing.tiers.enabled and c.enabled
    counters.configure(enabled=on, min_tokens=c.min_tokens, distrust_below=c.distrust_below)


def configure_tiers(tiers: TierIndex, cfg: GatewayConfig, pools: Pools) -> None:
    t = cfg.routing.tiers
    if not t.enabled:  # nothing learned or demoted into them (the router reads none)
        tiers.l1_capacity, tiers.l2_capacity, tiers.l2_learn = (lambda url: None), 0, False
    else:
        tiers.l1_capacity = (lambda url: t.l1_blocks) if t.l1_blocks is not None else pools.cpu_blocks
        tiers.l2_capacity, tiers.l2_learn = t.l2_blocks, t.l2_learn
    block = cfg.routing.prefix.block_size or pools.block_size() or DEFAULT_BLOCK_SIZE
    tiers.chunk_blocks = max(1, t.chunk_tokens // block)
    tiers.ttl_s = cfg.routing.prefix.learned_ttl_s


@dataclass(frozen=True)
class _Parts:
    """The long-lived parts ``assemble`` built, as it built them (none optional but these three)."""

    subs: Subscriptions
    discovery: Discovery
    health: HealthChecker
    scraper: StatsScraper
    planner: DemandPlanner
    engines: EngineTransport
    session: aiohttp.ClientSession
    bus: WorkerBus | None
    shared: RedisState | None
    watcher: ConfigWatcher | None


def _register(life: Lifecycle, gw: Gateway, p: _Parts, collector: Collector | None, cfg: GatewayConfig) -> None:
    """Every long-lived part in the lifecycle: resources (closed after every service stopped, last
    added first), then the services in the order they start (a later one may read what an earlier
    one found)."""
    s = gw.services
    life.add("access log", stop=s.access_log.close, resource=True)
    life.add("tracing", stop=lambda: _flush(s.tracing), resource=True)
    life.add("tokenizers", stop=lambda: gw.runtime.tokenizers.close(), resource=True)
    life.add("engine connections", stop=p.engines.close, resource=True)
    life.add("control-plane session", stop=p.session.close, resource=True)
    life.add("admission gate", stop=s.gate.close, resource=True)
    if (bus := p.bus) is not None:
        s.metrics.watch_bus(bus)
        life.add("worker bus", start=lambda: bus.start(s.metrics.render), stop=bus.stop)
    life.add("kv event feeds", start=lambda: p.subs.update(cfg), stop=p.subs.close)
    if p.shared:
        life.add("redis state", start=p.shared.start, stop=p.shared.stop)
    life.add("discovery", start=lambda: p.discovery.start(cfg), stop=p.discovery.close)
    life.add(
        "health checks", start=p.health.start, stop=p.health.stop, configure=lambda c: p.health.configure(c.health)
    )
    life.add(
        "engine stats", start=p.scraper.start, stop=p.scraper.stop, configure=lambda c: p.scraper.configure(c.signals)
    )
    life.add("loop lag", start=s.lag.start, stop=s.lag.stop)
    if s.models is not None:
        models = s.models
        life.add("model lists", start=models.start, stop=models.stop)
    if s.loader is not None:
        loader = s.loader
        life.add("adapter loader", stop=loader.close, configure=lambda c: loader.configure(c.lora))
    if (learned := s.learners) is not None and learned.tiers is not None:
        tiers = learned.tiers.tiers
        life.add("tier beliefs", configure=lambda c: configure_tiers(tiers, c, s.pools))
    if learned is not None and (counters := learned.counters) is not None:
        life.add("tier counter check", configure=lambda c: configure_counter_check(counters, c))
    life.add("kv releaser", stop=s.releaser.close)
    life.add("live planner", start=p.planner.start, stop=p.planner.stop)
    if p.watcher:
        life.add("config watcher", start=p.watcher.start, stop=p.watcher.stop)
    if cfg.epp.enabled:  # grpclib and Envoy's messages only in a picker's processes
        from gateway.epp.server import PickerServer

        picker = PickerServer(gw)
        life.add("endpoint picker", start=picker.start, stop=picker.stop, drain=picker.drain)
    if collector:  # last: it freezes what startup left alive

        def start_gc() -> None:
            collector.tune()
            collector.settle()

        life.add("gc policy", start=start_gc, stop=collector.close, configure=lambda c: collector.settle_later())


async def _flush(tracing: Tracing) -> None:
    try:  # flushing spans may block on the exporter
        async with asyncio.timeout(STOP_BOUND_S):
            await asyncio.to_thread(tracing.shutdown)
    except TimeoutError:
        log.warning("tracing: spans not flushed within %.0f s at shutdown", STOP_BOUND_S)
