"""From a tokenized request to a routing decision: hash the prompt's blocks, ask the prefix index
(and the prompts in flight) which endpoint holds how much of it, publish the per-request data
policies read (``RequestContext.data``: the gateway's measurements, then what the pipeline's own
publishers put there), and run the policy pipeline over the engines that serve the request's model.
What the request teaches comes later, through the lifecycle hooks
(policies/beliefs/prefix_learning.py)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.cluster.redis_state import RedisState
from gateway.config import PolicySpec, PoolRoutingConfig, RoutingConfig
from gateway.engines.pools import Endpoint, Pools
from policies.base import (
    MEASURED,
    NOTHING_MEASURED,
    Decider,
    EndpointView,
    Filter,
    Measured,
    NoPairing,
    Path,
    Picker,
    PoolSnapshot,
    Publisher,
    RequestContext,
    Scorer,
)
from policies.beliefs.blockhash import DEFAULT_BLOCK_SIZE, BlockHash, HashSpec, block_hashes
from policies.beliefs.prefix_index import PrefixIndex
from policies.beliefs.prefix_learning import InFlightPrefixes
from policies.beliefs.tiers import TIERS, TierHold, TierIndex
from policies.data import Key
from policies.pipeline import PoolPipeline, Route, RoutingPipeline, Weighted
from policies.registry import build


def _build(spec: PolicySpec, kind: type) -> Any:
    return build(spec.name, spec.params, kind, spec.instance_name)


def _pool_pipeline(cfg: PoolRoutingConfig) -> PoolPipeline:
    return PoolPipeline(
        picker=_build(cfg.picker, Picker),
        filters=tuple((f.instance_name, _build(f, Filter)) for f in cfg.filters),
        scorers=tuple(Weighted(s.instance_name, _build(s, Scorer), s.weight) for s in cfg.scorers),
        picker_name=cfg.picker.instance_name,
    )


def build_pipeline(cfg: RoutingConfig) -> RoutingPipeline:
    """The policies the YAML names, each with its instance name (the traces' and hooks' name for
    it); raises PolicyError (a ValueError) for unknown names or params."""
    return RoutingPipeline(
        decider=_build(cfg.decider, Decider),
        decode=_pool_pipeline(cfg.decode),
        prefill=_pool_pipeline(cfg.prefill),
        decider_name=cfg.decider.instance_name,
    )


@dataclass(frozen=True, slots=True)
class Published:
    """A gateway-side publisher of one value for every request (an object that outlives the
    request, such as the measurements)."""

    key: Key[Any]
    value: Any

    def publish(self, ctx: RequestContext) -> None:
        ctx.data.put(self.key, self.value)


class Saturated(RuntimeError):
    """Every healthy engine of a pool the request needs (``phase``) is at its in-flight limit."""

    def __init__(self, phase: str = "decode") -> None:
        super().__init__(f"every healthy {phase} engine is at its in-flight limit")
        self.phase = phase


class NotServed(RuntimeError):
    """No healthy decode engine serves the request's model (by its /v1/models)."""


def _serving(snap: PoolSnapshot, gaps: frozenset[tuple[str, str]], model: str, *, strict: bool = True) -> PoolSnapshot:
    """The snapshot without the endpoints in ``gaps`` (known not to serve ``model``); ``strict``:
    raise NotServed when that leaves no healthy decode engine where there was one."""
    if not gaps:
        return snap
    decode = tuple(v for v in snap.decode if (v.pool, v.url) not in gaps)
    if strict and not any(v.healthy for v in decode) and any(v.healthy for v in snap.decode):
        raise NotServed(model)
    return PoolSnapshot(tuple(v for v in snap.prefill if (v.pool, v.url) not in gaps), decode)


def _with_capacity(snap: PoolSnapshot, max_prefill: int, max_decode: int) -> PoolSnapshot:
    """The snapshot without the engines at their in-flight limit (0: no limit)."""

    def room(views: tuple[EndpointView, ...], limit: int) -> tuple[EndpointView, ...]:
        return views if not limit else tuple(v for v in views if v.in_flight < limit)

    decode = room(snap.decode, max_decode)
    if not any(v.healthy for v in decode) and any(v.healthy for v in snap.decode):
        raise Saturated("decode")
    return PoolSnapshot(room(snap.prefill, max_prefill), decode)


@dataclass(frozen=True, slots=True)
class Prepared:
    ctx: RequestContext
    hashes: Sequence[BlockHash]
    block_size: int
    # A LoRA adapter the gateway may load on an engine that lacks it (dynamic loading): engines
    # with LoRA on stay candidates even when they do not list it.
    loadable: bool = False


class Router:
    """One config's routing: immutable after construction (a reload builds a new Router), sharing
    the pools, the prefix index, the prompts in flight and the measurements, which outlive reloads."""

    def __init__(
        self,
        cfg: RoutingConfig,
        pools: Pools,
        index: PrefixIndex,
        shared: RedisState | None = None,
        in_flight: InFlightPrefixes | None = None,
        measured: Measured = NOTHING_MEASURED,
        publishers: Iterable[Publisher] = (),
        tiers: TierIndex | None = None,
    ) -> None:
        """``measured`` is published as ``MEASURED``; ``publishers``: the gateway's other sources of
        per-request data, published before the pipeline's own (which may read them)."""
        self.cfg = cfg
        self.pipeline = build_pipeline(cfg)
        self._pools = pools
        self._index = index
        self._shared = shared
        self._in_flight = in_flight if in_flight is not None else InFlightPrefixes()
        self._tiers = tiers if cfg.tiers.enabled else None
        self._publishers: tuple[Publisher, ...] = (
            Published(MEASURED, measured),
            *publishers,
            *self.pipeline.publishers,
        )
        self._spec: HashSpec | None = None
        if cfg.prefix.enabled:  # fails now, not on the first request, for an unusable hash algo
            try:
                self.hash_spec()
            except ImportError as err:
                raise ValueError(f"routing.prefix.hash_algo: {err}") from None

    def hash_spec(self) -> HashSpec | None:
        """The engines' hashing; one object per block size, as it carries the hash memo that makes
        a returning conversation cheap."""
        p = self.cfg.prefix
        if not p.enabled:
            return None
        size = p.block_size or self._pools.block_size() or DEFAULT_BLOCK_SIZE
        if self._spec is None or self._spec.block_size != size:
            self._spec = HashSpec(block_size=size, algo=p.hash_algo, seed=p.hash_seed)
        return self._spec

    async def prepare(
        self,
        model: str,
        request_id: str,
        token_ids: Sequence[int],
        local_only: str | None,
        headers: Mapping[str, str],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        loadable: bool = False,
    ) -> Prepared:
        """``lora``: the (name, path) of the LoRA adapter the request names, hashed into every block
        as the engines do; ``loadable``: dynamic loading may put it on an engine lacking it."""
        spec = self.hash_spec()
        hashes: Sequence[BlockHash] = ()
        settled: Mapping[str, int] = {}
        cached: Mapping[str, int] = {}
        if spec is not None and len(token_ids) >= spec.block_size:
            hashes = block_hashes(token_ids, spec, cache_salt=cache_salt, lora=lora)
            blocks = self._index.match(hashes)
            if self._shared is not None:  # what other replicas routed (bounded wait; {} when Redis is down)
                for url, n in (await self._shared.match(hashes)).items():
                    if n > blocks.get(url, 0):
                        blocks[url] = n
            in_flight = self._in_flight.extend(hashes, blocks)
            off, size = self._pools.caching_off_urls, spec.block_size
            settled = {url: n * size for url, n in blocks.items() if url not in off}
            cached = (
                settled if in_flight is blocks else {url: n * size for url, n in in_flight.items() if url not in off}
            )
        ctx = RequestContext(
            model,
            request_id,
            token_ids,
            local_only,
            headers,
            cached,
            settled,
            hashes,
            spec.block_size if spec else 0,
            adapter=lora[0] if lora else None,
        )
        if self._tiers is not None and hashes and spec is not None:
            ctx.data.put(TIERS, self._tier_holds(ctx, hashes, spec.block_size))
        for publisher in self._publishers:
            publisher.publish(ctx)
        return Prepared(ctx, hashes, spec.block_size if spec else 0, loadable and lora is not None)

    def _tier_holds(self, ctx: RequestContext, hashes: Sequence[BlockHash], size: int) -> dict[str, TierHold]:
        """Each engine's tier breakdown of the prompt: its GPU hit, then what it can load from its
        L1 or the shared L2 past that (tokens, capped as the engine counts cached tokens)."""
        assert self._tiers is not None
        room = ctx.prompt_tokens - 1 - (ctx.prompt_tokens - 1) % size  # whole blocks, not the last token
        holds = {}
        for url in {e.url for e in self._pools.all()}:
            gpu = ctx.cached(url)
            l1, l2 = self._tiers.walk(url, hashes, gpu // size)
            l1_tokens = min(l1 * size, max(room - gpu, 0))
            holds[url] = TierHold(gpu, l1_tokens, min(l2 * size, max(room - gpu - l1_tokens, 0)))
        return holds

    def route(
        self,
        prep: Prepared,
        *,
        explain: bool = False,
        max_decode: int = 0,
        max_prefill: int = 0,
        exclude: Collection[str] = (),
        wait_for_prefill: bool = False,
    ) -> Route:
        """Raises NoEndpointError (no healthy decode engine), NotServed (none serving the model) or
        Saturated (all at ``max_decode``; with ``wait_for_prefill``, a P/D request whose prefill
        engines are all at ``max_prefill``, instead of sending it direct). ``exclude``: decode
        engines this request must not use (a migration's continuation leaves out those that failed it)."""
        model = prep.ctx.model
        snap = _serving(self._pools.snapshot(), self._pools.not_serving(model, loadable=prep.loadable), model)
        if exclude:
            snap = PoolSnapshot(snap.prefill, tuple(v for v in snap.decode if v.url not in exclude))
        full = snap
        if max_decode or max_prefill:
            snap = _with_capacity(snap, max_prefill, max_decode)
        route = self.pipeline.route(prep.ctx, snap, explain=explain)
        if (
            wait_for_prefill
            and route.decision.reason == "no_prefill_endpoint"
            and any(v.healthy and v not in snap.prefill for v in full.prefill)
        ):  # at its limit
            # What the decider would choose with room in the prefill pool: a decider that weighs
            # both paths (the cost model) cannot without a prefill engine to price.
            roomy = self.pipeline.route(prep.ctx, PoolSnapshot(full.prefill, snap.decode), explain=explain)
            if roomy.decision.path is Path.PD:
                raise Saturated("prefill")
            return roomy
        return route

    def other(
        self, prep: Prepared, pool: str, exclude: set[str], paired: EndpointView | None = None
    ) -> Endpoint | None:
        """The pool's next choice for this request without the ``exclude``d engines (failover);
        ``paired``: for the prefill pool, the decode engine that will pull the KV."""
        model = prep.ctx.model
        snap = _serving(self._pools.snapshot(), self._pools.not_serving(model), model, strict=False)
        views = snap.prefill if pool == "prefill" else snap.decode
        pipe = self.pipeline.prefill if pool == "prefill" else self.pipeline.decode
        ctx = replace(prep.ctx, paired=paired) if paired is not None else prep.ctx
        try:
            view = pipe.choose(ctx, [v for v in views if v.url not in exclude])
        except NoPairing:
            return None
        return self._pools.get(view) if view is not None else None
