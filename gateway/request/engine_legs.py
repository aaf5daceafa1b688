"""A part's engine legs, from its route to the decode engine's first token, with failover.

``EngineLegs`` opens the legs of one part of a request's answer (the request as the client sent
it, or a migration's continuation): the prefill leg on the P/D path, then the decode leg up to its
first token (or whole answer); the relay ends the decode leg once it has sent it on. Failover
happens here, before the client has received a byte: a failed prefill leg is retried on another
prefill engine, then (if ``failover.fallback_to_direct``) the request goes direct; a decode leg
that fails before its first token is retried on another decode engine, keeping the KV handle only
when the failed engine never saw the request (one that did may have told the prefill engine to
drop the blocks, so the retry computes the prompt itself). Each leg's accounting lives here too,
so that every path gives back what it took: the endpoint's in-flight count and backlog, the
tenant's prefill and decode use (gateway/fairness/accounting.py), the leg's span, the record's leg
fields, and the hooks' ``on_routed`` and ``on_leg_done``. The engine I/O of one leg is
gateway/engines/legs.py; the exchange (gateway/request/exchange.py) and a migration
(gateway/request/migrator.py) drive this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.adapters.loader import AdapterUnavailable
from gateway.context import Runtime, Services
from gateway.engines import legs
from gateway.engines.legs import DecodeStream, LegFailed, PrefillAnswer
from gateway.engines.pools import Endpoint
from gateway.fairness.accounting import TenantAccount
from gateway.fairness.tenants import Identity
from gateway.http.errors import APIError
from gateway.ops.requestlog import RequestRecord
from gateway.ops.tracing import RequestTrace
from gateway.request.router import Prepared
from policies.base import Decision, EndpointView, LegOutcome, LegReport, Path, RequestContext

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Part:
    """One engine request the client's answer comes from: the request as the client sent it
    (``number`` 0), or after a migration its continuation on another decode engine: a
    ``/v1/completions`` request over the prompt plus the output kept, with a context of its own."""

    number: int
    path: str  # the engines' route
    body: dict[str, Any]  # the decode leg's body (the prefill leg's is made from it)
    stream: bool  # the decode leg streams (a migratable request's always does)
    prep: Prepared
    request_id: str  # both legs' X-Request-Id
    trace: RequestTrace  # where its legs' spans go
    decision: Decision | None = None
    prefilled_on: Endpoint | None = None  # the prefill engine that answered, if any
    reports: list[LegReport] = field(default_factory=list)  # every engine leg attempt, as the hooks were told
    max_head_bytes: int = 0  # a migratable answer's: the largest first event its decode leg may wait for

    @property
    def ctx(self) -> RequestContext:
        return self.prep.ctx


@dataclass(slots=True)
class OpenDecode:
    """A decode leg past its first token (or whole answer), until the relay has sent it on."""

    part: Part
    stream: DecodeStream
    ep: Endpoint
    path: Path
    started: float
    first_token_s: float | None
    tokens: int  # the gateway's belief: uncached prompt tokens on this engine
    prefill_url: str | None
    span: Any
    occupancy: tuple[str, float] | None = None  # (tenant key, expected output tokens) in its decode use


class EngineLegs:
    """The engine legs of one request's parts; ``failed_decode`` keeps the decode engines whose leg
    broke off mid-answer, which its continuations avoid."""

    def __init__(
        self, rt: Runtime, svc: Services, rec: RequestRecord, account: TenantAccount | None, who: Identity | None
    ) -> None:
        self.rt = rt
        self.svc = svc
        self.rec = rec
        self.account = account  # the request's charges to its tenant's use of each pool
        self.who = who
        self.failed_decode: set[str] = set()

    async def open(self, part: Part) -> OpenDecode:
        """The part's route told to the hooks (on the loop's next turn, off the critical path), then
        its legs: prefill on the P/D path, then decode up to its first token."""
        handle = await self.prepare(part)
        assert part.decision is not None
        return await self._decode(part, part.decision, handle)

    async def prepare(self, part: Part, *, prefill: bool = True) -> PrefillAnswer | None:
        """Everything before the decode leg: the route told to the hooks, the request's adapter on
        the chosen engines, and on the P/D path the prefill leg (its KV handle; None: direct, or
        ``prefill`` false: someone else runs it). The endpoint picker (gateway/epp/) stops here:
        Envoy opens the decode leg."""
        decision = part.decision
        assert decision is not None, "routed parts only"
        asyncio.get_running_loop().call_soon(self._routed, part)
        chosen = [decision.prefill, decision.decode] if decision.prefill is not None else [decision.decode]
        await self._adapter_on(part, [self.svc.pools.get(v) for v in chosen])  # both legs' loads at once
        return await self._prefill(part, decision) if decision.path is Path.PD and prefill else None

    def report(self, part: Part, report: LegReport) -> None:
        """A leg the gateway did not run itself ended (the picker's decode leg, as Envoy reported it)."""
        self._leg_done(part, report)

    async def _adapter_on(self, part: Part, eps: list[Endpoint]) -> None:
        """The request's LoRA adapter loaded on ``eps`` where they lack it (``lora.dynamic_loading``;
        a failover engine too); 503 when it cannot be. Nothing for base-model requests."""
        loader, name = self.svc.loader, part.ctx.adapter
        if loader is None or name is None or not part.prep.loadable or self.rt.adapters is None:
            return
        adapter = self.rt.adapters.resolve(name)
        if adapter is None:
            return
        try:
            reports = await loader.ensure(eps, adapter)
        except AdapterUnavailable as err:
            raise APIError(503, str(err), code="adapter_unavailable", type_="ServiceUnavailableError") from None
        self.rec.adapter_loads.extend(r.as_dict() for r in reports)

    def end(self, leg: OpenDecode, outcome: LegOutcome, clean: bool, status: int, cached: int | None) -> None:
        """The decode leg is over: its connection closed (kept for reuse if ``clean``), its slot on
        the engine and its tenant's use given back, the hooks told. ``cached``: the engine's own
        count of prompt tokens its cache served (its usage)."""
        leg.stream.close(reuse=clean)
        self._vacate(leg.occupancy)
        leg.ep.release()
        leg.span.end(None if clean or outcome is LegOutcome.OK else "decode stream cut short")
        self._leg_done(
            leg.part,
            LegReport(
                "decode",
                leg.ep.url,
                outcome,
                leg.path,
                time.perf_counter() - leg.started,
                first_token_s=leg.first_token_s,
                uncached_tokens=leg.tokens,
                prefill_url=leg.prefill_url,
                status=status,
                # on the P/D path vLLM reports the prefill engine's cache hit here, not this engine's
                cached_tokens=cached if leg.path is Path.DIRECT else None,
            ),
        )

    # -- prefill ----------------------------------------------------------------------------------------

    async def _prefill(self, part: Part, decision: Decision) -> PrefillAnswer | None:
        """Steps 1-2 of the handshake, on the chosen prefill engine, else another one, else none:
        then the request goes direct (``failover.fallback_to_direct``)."""
        assert decision.prefill is not None
        ep, retries = self.svc.pools.get(decision.prefill), self.rt.cfg.failover.prefill_retries
        tried = {ep.url}
        for attempt in range(retries + 1):
            try:
                answer = await self._prefill_leg(part, ep)
                ep.record(True)
                part.prefilled_on = ep
                return answer
            except LegFailed as failed:
                if not legs.retryable(failed.err):
                    raise failed.err from None
                ep.record(False)
                log.warning("request %s: prefill leg on %s failed (%s)", part.request_id, ep.url, failed.err.message)
                other = self._other(part, "prefill", tried, decision.decode) if attempt < retries else None
                if other is None:
                    if not self.rt.cfg.failover.fallback_to_direct:
                        raise failed.err from None
                    self._failover("prefill_fallback_direct", failed.err, ep)
                    self.rec.prefill = ""
                    return None
                self._failover("prefill_retried", failed.err, ep)
                ep = other
                tried.add(ep.url)
        raise AssertionError("unreachable: the loop returns or raises")

    async def _prefill_leg(self, part: Part, ep: Endpoint) -> PrefillAnswer:
        rec = self.rec
        await self._adapter_on(part, [ep])  # a retry's engine may lack the adapter
        tokens = part.ctx.uncached(ep.url)
        ticket = ep.start_prefill(tokens)
        if self.account is not None and self.who is not None:  # the tenant's prefill use
            self.account.prefill_sent(tokens)
            self.svc.metrics.tenant_prefill(self.rec.tenant_label, self.who.cls, tokens)
        span = part.trace.leg("prefill", ep.url)
        span.set("pdgate.uncached_tokens", tokens)
        started = time.perf_counter()
        outcome, status, answer = LegOutcome.ABANDONED, 0, None
        ep.acquire()
        try:
            answer = await legs.prefill(self.rt.upstream, ep, part.path, part.body, part.request_id, span.headers)
            outcome, status = LegOutcome.OK, 200
            return answer
        except LegFailed as failed:
            outcome, status = _failed(failed), failed.err.status
            raise
        finally:
            ep.release()
            ep.end_prefill(ticket)
            seconds = time.perf_counter() - started
            leg_outcome = "ok" if outcome is LegOutcome.OK else "error"
            if part.number == 0:
                rec.prefill_legs.append((leg_outcome, seconds))
                rec.prefill = ep.url
            else:  # a continuation's: in its migration's record, and in the prefill histogram
                rec.migrations[-1].update(prefill=ep.url, prefill_ms=round(seconds * 1000, 3))
                self.svc.metrics.prefill_attempt(rec.model, leg_outcome, seconds)
            span.end(None if outcome is LegOutcome.OK else outcome.value)
            self._leg_done(
                part,
                LegReport(
                    "prefill",
                    ep.url,
                    outcome,
                    Path.PD,
                    seconds,
                    uncached_tokens=tokens,
                    queued_tokens=ticket.ahead,
                    status=status,
                    cached_tokens=answer.cached_tokens if answer else None,
                ),
            )

    # -- decode -----------------------------------------------------------------------------------------

    async def _decode(self, part: Part, decision: Decision, handle: PrefillAnswer | None) -> OpenDecode:
        """Step 3 up to its first token, on the chosen decode engine, else another one."""
        ep, retries = self.svc.pools.get(decision.decode), self.rt.cfg.failover.decode_retries
        tried = {ep.url, *self.failed_decode}
        try:
            for attempt in range(retries + 1):
                try:
                    leg = await self._decode_leg(part, ep, handle)
                    ep.record(True)
                    return leg
                except LegFailed as failed:
                    if not legs.retryable(failed.err):
                        raise failed.err from None
                    source = part.prefilled_on if handle is not None else None
                    if source is None or (source.healthy and not source.ejected):
                        ep.record(False)  # else the KV's source is gone: not this engine's failure
                    log.warning("request %s: decode leg on %s failed (%s)", part.request_id, ep.url, failed.err.message)
                    other = self._other(part, "decode", tried) if attempt < retries else None
                    if (
                        other is None
                        and handle is not None
                        and failed.reached
                        and attempt < retries
                        and ep.healthy
                        and not ep.ejected
                    ):
                        # No other decode engine: what failed may be the KV's source (a prefill
                        # engine gone mid-pull), so this one computes the prompt itself.
                        other = ep
                    if other is None:
                        raise failed.err from None
                    self._failover("decode_retried", failed.err, ep)
                    if failed.reached:
                        handle = None  # its blocks may be gone: the next engine prefills itself
                    ep = other
                    tried.add(ep.url)
            raise AssertionError("unreachable: the loop returns or raises")
        except asyncio.CancelledError:
            if handle is not None:  # the client left: its prefilled KV need not wait out the lease
                self.svc.releaser.release(ep, part.ctx.model, handle.kv_params, part.request_id)
            raise

    async def _decode_leg(self, part: Part, ep: Endpoint, handle: PrefillAnswer | None) -> OpenDecode:
        """A direct stream prefills its uncached tokens on the engine first: they count in its
        backlog until the first token (the cost model's queue estimate); a whole answer's first
        token cannot be seen, so non-streamed legs do not count."""
        rec = self.rec
        await self._adapter_on(part, [ep])  # a failover's engine may lack the adapter
        path = Path.DIRECT if handle is None else Path.PD
        body = part.body if handle is None else {**part.body, "kv_transfer_params": handle.kv_params}
        prefill_url = part.prefilled_on.url if handle is not None and part.prefilled_on else None
        tokens = part.ctx.uncached(ep.url)
        span = part.trace.leg("decode", ep.url)
        span.set("pdgate.kv_from_prefill", handle is not None)
        ticket = ep.start_prefill(tokens if handle is None and part.stream else 0)
        started = time.perf_counter()
        rec.decode = ep.url
        occupancy = self._occupy(part)
        ep.acquire()
        try:
            stream = await legs.open_decode(
                self.rt.upstream,
                ep,
                part.path,
                body,
                part.request_id,
                part.stream,
                span.headers,
                max_head_bytes=part.max_head_bytes,
            )
        except BaseException as err:
            self._vacate(occupancy)
            ep.release()
            outcome = _failed(err) if isinstance(err, LegFailed) else LegOutcome.ABANDONED
            span.end(outcome.value)
            self._leg_done(
                part,
                LegReport(
                    "decode",
                    ep.url,
                    outcome,
                    path,
                    time.perf_counter() - started,
                    uncached_tokens=tokens,
                    prefill_url=prefill_url,
                    status=err.err.status if isinstance(err, LegFailed) else 0,
                ),
            )
            raise
        finally:
            ep.end_prefill(ticket)
        first = None
        if part.stream:
            first = time.perf_counter() - started
            span.set("pdgate.first_token_s", first)
            if rec.stream and part.number == 0:  # what the client's stream waited for
                rec.decode_first_token_s = first
                rec.itl = self.svc.metrics.itl_for(rec.model, path.value)
        return OpenDecode(part, stream, ep, path, started, first, tokens, prefill_url, span, occupancy)

    # -- bookkeeping ------------------------------------------------------------------------------------

    def _occupy(self, part: Part) -> tuple[str, float] | None:
        """The decode leg in its tenant's decode use (gateway/fairness/accounting.py)."""
        return self.account.decode_started(part.body) if self.account is not None else None

    def _vacate(self, occupancy: tuple[str, float] | None) -> None:
        if occupancy is not None and self.account is not None:
            self.account.decode_ended(occupancy)

    def _other(self, part: Part, pool: str, exclude: set[str], paired: EndpointView | None = None) -> Endpoint | None:
        return self.rt.router.other(part.prep, pool, exclude, paired)

    def _failover(self, event: str, err: APIError, ep: Endpoint) -> None:
        cause = err.code or "engine_error"
        self.rec.failover.append(event)
        self.rec.trace.event(event, {"pdgate.cause": cause, "pdgate.failed_endpoint": ep.url})
        self.svc.metrics.failover(event, cause)

    def _routed(self, part: Part) -> None:
        assert part.decision is not None
        self.rt.hooks.routed(part.ctx, part.decision)
        if part.number == 0:  # a continuation's route is counted with its migration
            self.svc.metrics.decided(part.decision.path.value, part.decision.reason)

    def _leg_done(self, part: Part, report: LegReport) -> None:
        part.reports.append(report)
        asyncio.get_running_loop().call_soon(self.rt.hooks.leg_done, part.ctx, report)


def _failed(failed: LegFailed) -> LegOutcome:
    if not failed.reached:
        return LegOutcome.UNREACHED
    return LegOutcome.REJECTED if 400 <= failed.err.status < 500 else LegOutcome.FAILED
