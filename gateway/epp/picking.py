"""One request the endpoint picker routes: the gateway's own request path up to the engine, then
held until Envoy reports how the request ended.

``PickExchange`` is an ``Exchange`` (gateway/request/exchange.py) that stops where ``serve`` would
open the decode leg: identify, read the body, parse, admit, tokenize and route exactly as ``serve``
does (the same config, policies, beliefs, fairness and errors); on the P/D path it runs the
prefill leg with ``serve``'s retries and fallback to direct and puts the KV handle in the body
(or, with ``epp.prefill: header``, names the prefill engine for llm-d's decode sidecar). What it
returns is the destination, ordered fallbacks and the body for Envoy.

The request is then **held**: its admission slot, its decode engine's in-flight count and the
prefix beliefs in flight stay until Envoy's access log entry for it arrives
(gateway/epp/completions.py), which says the status, the engine that served it (a fallback, if
Envoy retried) and when its first byte came; that ends the decode leg in the beliefs and the
request in metrics and the access log, as ``serve`` would. No entry within
``epp.completion_timeout_s``: released and counted as unconfirmed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

import orjson
from starlette.requests import Request

from gateway.config import EppConfig
from gateway.context import Runtime, Services
from gateway.engines.pools import Endpoint
from gateway.epp.protocol import PREFILLER, allowed, host_port
from gateway.http.errors import APIError
from gateway.request.engine_legs import EngineLegs, Part
from gateway.request.exchange import CLIENT_CLOSED, Exchange
from gateway.request.protocol import Kind
from policies.base import Decision, LegOutcome, LegReport, Path

log = logging.getLogger(__name__)

_INTERNAL = APIError(500, "The gateway failed to route this request.", code="internal_error")


@dataclass(slots=True)
class Picked:
    """The picker's answer: where (``endpoints``: the chosen one, then fallbacks, each ``ip:port``),
    what to send (``body``), which request headers to set, the client's ``x-pdgate-*`` response
    headers (``decision``: Envoy adds them from the dynamic metadata); or ``refusal``, which Envoy
    answers itself (with ``headers`` as its response headers)."""

    endpoints: list[str] = field(default_factory=list)
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    decision: dict[str, str] = field(default_factory=dict)
    refusal: APIError | None = None


def request_of(headers: list[tuple[bytes, bytes]], method: str, path: str, body: bytes) -> Request:
    """A Starlette request over what Envoy sent: the exchange reads it as it reads a client's."""
    sent = False

    async def receive() -> dict[str, object]:
        nonlocal sent
        if sent:  # nothing reads past the body: the picker's exchange never watches for a hang-up
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    path_only, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": method,
        "path": path_only,
        "raw_path": path_only.encode(),
        "query_string": query.encode(),
        "headers": headers,
        "scheme": "http",
        "server": None,
        "client": None,
    }
    return Request(scope, receive)


class PickExchange(Exchange):
    """One routed request of the picker (module docstring)."""

    def __init__(self, rt: Runtime, svc: Services, request: Request, kind: Kind, path: str, epp: EppConfig) -> None:
        super().__init__(rt, svc, request, kind, path)
        self.epp = epp
        self._part: Part | None = None
        self._legs: EngineLegs | None = None
        self._held: Endpoint | None = None  # the decode engine counted in flight until the end
        self._endpoints: dict[str, str] = {}  # ip:port -> engine URL, of the destination and fallbacks
        self._path = Path.DIRECT
        self._prefill_url: str | None = None
        self._picked_at = 0.0
        self.held = False  # waiting for Envoy's report (``served`` or ``unconfirmed`` ends it)

    async def pick(self, subset: frozenset[str] | None) -> Picked:
        """Route the request; never raises but for cancellation (Envoy dropped the stream: the
        client left). A refusal ends the request here; a route holds it (``held``)."""
        try:
            return await self._choose(subset)
        except APIError as err:
            self.outcome.set(err.status, err.message)
            self._end()
            return Picked(refusal=err, headers=[(k.decode(), v.decode()) for k, v in self._headers(failed=True)])
        except asyncio.CancelledError:
            self.outcome.set(CLIENT_CLOSED, "client disconnected")
            self._end()
            raise
        except Exception:  # a bug: still an OpenAI-shaped answer, never a hang
            log.exception("request %s failed", self.rec.request_id)
            self.outcome.set(500, _INTERNAL.message)
            self._end()
            return Picked(refusal=_INTERNAL)

    async def _choose(self, subset: frozenset[str] | None) -> Picked:
        self._identify()
        body = await self._read_body()
        req = self._parse(body)
        await self._admit()
        await self._tokenize(req)
        route = await self._route(req)
        decision = self.decision = self._within(route.decision, subset)
        legs = self._legs = EngineLegs(self.rt, self.svc, self.rec, self.account, self.who)
        assert self.prep is not None
        part = self._part = Part(
            0, self.path, req.body, req.stream, self.prep, self.rec.request_id, self.rec.trace, decision
        )
        self.parts.append(part)
        headers = [("x-request-id", self.rec.request_id)]
        picker_prefills = self.epp.prefill == "picker"
        handle = await legs.prepare(part, prefill=picker_prefills)
        out = req.body
        if decision.path is Path.PD and decision.prefill is not None:
            if not picker_prefills:
                self._path, self._prefill_url = Path.PD, decision.prefill.url
                headers.append((PREFILLER, host_port(decision.prefill.url)))
            elif handle is not None:
                self._path = Path.PD
                self._prefill_url = part.prefilled_on.url if part.prefilled_on else None
                out = {**req.body, "kv_transfer_params": handle.kv_params}
        self.rec.path = self._path.value
        endpoints = self._destinations(decision, subset)
        ep = self._held = self.svc.pools.get(decision.decode)
        ep.acquire()
        self.rec.decode = ep.url
        self.held = True
        self._picked_at = time.perf_counter()
        # the client's x-pdgate-* headers: in the dynamic metadata, which Envoy's config turns into
        # response headers (the picker never sees the response)
        shown = {k.decode(): v.decode() for k, v in self._headers(path=self._path) if k != b"x-request-id"}
        return Picked(
            endpoints=endpoints,
            # the client's bytes as sent, unless the gateway changed the body (KV handle, priority)
            body=body if out is req.body and not self.rewritten else orjson.dumps(out),
            headers=headers,
            decision=shown,
        )

    def _within(self, decision: Decision, subset: frozenset[str] | None) -> Decision:
        """The decision with its decode engine inside the data plane's subset hint (503 if none is)."""
        if subset is None or allowed(decision.decode.url, subset):
            return decision
        assert self.prep is not None
        outside = {e.url for e in self.svc.pools.decode if not allowed(e.url, subset)}
        other = self.rt.router.other(self.prep, "decode", outside | {decision.decode.url})
        if other is None:
            raise APIError(
                503,
                "No engine the gateway may route to can serve this request.",
                code="no_endpoint_in_subset",
                type_="ServiceUnavailableError",
            )
        return _with_decode(decision, other)

    def _destinations(self, decision: Decision, subset: frozenset[str] | None) -> list[str]:
        """The chosen decode engine, then up to ``epp.fallbacks`` others in the policies' order."""
        assert self.prep is not None
        chosen = [decision.decode.url]
        exclude = {decision.decode.url}
        if subset is not None:
            exclude |= {e.url for e in self.svc.pools.decode if not allowed(e.url, subset)}
        for _ in range(self.epp.fallbacks):
            other = self.rt.router.other(self.prep, "decode", exclude)
            if other is None:
                break
            chosen.append(other.url)
            exclude.add(other.url)
        self._endpoints = {host_port(url): url for url in chosen}
        return [host_port(url) for url in chosen]

    # -- the end, as Envoy reports it ---------------------------------------------------------------------

    def served(self, status: int, upstream: str | None, first_byte_s: float | None, duration_s: float | None) -> None:
        """Envoy's access log entry: the request ended with ``status`` from ``upstream`` (``ip:port``;
        None: it reached no engine)."""
        if not self.held:
            return
        url = self._endpoints.get(upstream or "")
        ok = 200 <= status < 400 and url is not None
        decided = self.decision.decode.url if self.decision else None
        if url is not None and url != decided:
            self.rec.failover.append("decode_retried_by_envoy")
            self.svc.metrics.failover("decode_retried_by_envoy", "envoy")
        self.rec.decode = url or self.rec.decode
        if first_byte_s is not None and self.rec.stream:
            self.rec.decode_first_token_s = first_byte_s
            self.rec.ttft_s = first_byte_s + (self._picked_at - self.rec.started)
        outcome = LegOutcome.OK if ok else LegOutcome.UNREACHED if url is None else LegOutcome.FAILED
        if self._held is not None:
            self._held.record(ok or url is None)  # an engine Envoy never reached is not judged here
        self._report(url or (decided or ""), outcome, status, duration_s, first_byte_s)
        self.outcome.set(status, "" if ok else f"the engine's answer was {status}")
        self.outcome.answered = ok
        self._end()

    def unconfirmed(self) -> None:
        """No access log entry came in time: released, counted as status 0 (unknown)."""
        if not self.held:
            return
        self._report(self.rec.decode, LegOutcome.ABANDONED, 0, None, None)
        self.outcome.set(0, "no access log entry from Envoy in time")
        self._end()

    def _report(self, url: str, outcome: LegOutcome, status: int, seconds: float | None, first: float | None) -> None:
        part, legs = self._part, self._legs
        if part is None or legs is None:
            return
        legs.report(
            part,
            LegReport(
                "decode",
                url,
                outcome,
                self._path,
                seconds if seconds is not None else time.perf_counter() - self._picked_at,
                first_token_s=first,
                uncached_tokens=part.ctx.uncached(url),
                prefill_url=self._prefill_url,
                status=status,
            ),
        )

    def _end(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None
        self.held = False
        self._finish()


def _with_decode(decision: Decision, decode: Endpoint) -> Decision:
    return replace(decision, decode=decode.view(), detail=f"{decision.detail}; subset hint moved decode")
