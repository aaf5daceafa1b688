"""One client request from admission to its last byte: the gateway's request path, top to bottom.

    authorize -> read the body -> admission slot -> parse, tokenize -> route
              -> engine legs: [prefill, with failover or fallback to direct] -> decode, with failover
              -> relay the answer (a decode leg broken mid-answer is migrated to another engine)
              -> finish: the slot released, the outcome recorded, hooks told

An ``Exchange`` owns its request and tells its story in ``_serve``; the steps with a life of their
own are collaborators it builds for the request and drives: ``TenantAccount``
(gateway/fairness/accounting.py: the request's charges to its tenant), ``Room``
(gateway/request/capacity.py: the wait for room on the engines), ``EngineLegs``
(gateway/request/engine_legs.py: each part's prefill and decode legs, failover before the first
token, every leg's accounting and its ``on_routed``/``on_leg_done`` hooks), ``Migrator``
(gateway/request/migrator.py: whether the answer may go on elsewhere, and its continuation when a
decode leg breaks off mid-answer) and ``AnswerRelay`` (gateway/request/answer_relay.py: the answer
written on the client's wire, gateway/request/relay.py's ``ClientWire``). The exchange keeps the
admission slot (released in ``_finish`` only), the ``RequestRecord`` (written by it and its
collaborators, read once by metrics and the access log), the route, the response headers, the
``Outcome`` the client got, and the end: ``on_finished`` told for every part, on the event loop's
next turn, off the request's critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from dataclasses import asdict
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.adapters.catalogue import Adapter
from gateway.context import Runtime, Services
from gateway.fairness.accounting import TenantAccount
from gateway.fairness.admission import too_busy
from gateway.fairness.fairqueue import QueueFull
from gateway.fairness.tenants import Identity
from gateway.http.auth import authorize
from gateway.http.errors import APIError, clip
from gateway.ops.requestlog import RequestRecord
from gateway.request.answer_relay import AnswerRelay, Outcome
from gateway.request.capacity import Room
from gateway.request.engine_legs import EngineLegs, Part
from gateway.request.migrator import Migrator, settle
from gateway.request.protocol import Kind, ParsedRequest, check_output_limit, parse_body, too_large
from gateway.request.relay import ClientWire, Headers
from gateway.request.router import Prepared
from gateway.tokenization.tokenizer import ModelTokenizer, PromptIds
from policies.base import Decision, Finished, Path, RequestContext
from policies.beliefs.tiers import TIERS
from policies.pipeline import Route

log = logging.getLogger(__name__)

PATH_HEADER = "x-pdgate-path"  # the path that served the request (failover may change the decided one)
TOKENS_HEADER = "x-pdgate-prompt-tokens"  # the gateway's own count, comparable with usage.prompt_tokens
ROUTE_HEADER = "x-pdgate-route"  # with routing.debug_headers: reason, numbers, endpoints
FAILOVER_HEADER = "x-pdgate-failover"
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", in metrics and logs only

_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TOKENS, _TOKENS_APPROXIMATE = TOKENS_HEADER.encode(), (TOKENS_HEADER + "-approximate").encode()
_ROUTE, _FAILOVER = ROUTE_HEADER.encode(), FAILOVER_HEADER.encode()
_PATH = {p: (PATH_HEADER.encode(), p.value.encode()) for p in Path}
_SHUTTING_DOWN = APIError(503, "The gateway is shutting down; the answer was cut short.", code="shutting_down")


def request_id(client_id: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (vLLM builds its response ids from it and
    suffixes its internal ids, so reuse cannot collide inside an engine), else a fresh one."""
    if client_id and _SAFE_ID.fullmatch(client_id):
        return client_id
    # 128 random bits as uuid4().hex has, without its os.urandom call (a syscall per request: 3% of
    # a request's CPU on a VM). Ids need to be unique, not secret: a client may choose its own.
    return f"{random.getrandbits(128):032x}"


class Exchange:
    def __init__(self, rt: Runtime, svc: Services, request: Request, kind: Kind, path: str) -> None:
        self.rt = rt  # the config version this request keeps to its end
        self.svc = svc
        self.request = request
        self.kind: Kind = kind
        self.path = path  # the route, also the engines' route
        self.rec = RequestRecord(request_id(request.headers.get("x-request-id")), kind)
        self.rec.trace = svc.tracing.start(f"POST {path}", request.headers, {"url.path": path})
        if self.rec.trace.span is not None:
            self.rec.trace.set({"http.request.method": "POST", "pdgate.request_id": self.rec.request_id})
        self.prompts: PromptIds | None = None
        self.prep: Prepared | None = None
        self.adapter: Adapter | None = None  # the LoRA adapter the request names, if it names one
        self.tok: ModelTokenizer | None = None  # its (base) model's tokenizer, once parsed
        self.decision: Decision | None = None
        self.parts: list[Part] = []  # the request's own, then one per migration
        self.outcome = Outcome()  # what the client was told
        self._admitted = False
        self._deadline = 0.0  # admission and engine capacity are waited for until then
        self.who: Identity | None = None  # tenant, class, objective
        self.account: TenantAccount | None = None  # its charges to its tenant's use of each pool
        self.room: Room | None = None  # its wait for room on the engines (and TTFT objective's check)
        self.rewritten = False  # the body was changed in parsing (the tenant's engine priority put in)

    # -- the request path -----------------------------------------------------------------------------

    async def run(self, client: ClientWire) -> None:
        """Serve the request; returns once the client has its answer (or is gone). Never raises
        but for cancellation (the client left, or the server is stopping)."""
        try:
            await self._serve(client)
        except APIError as err:
            self.outcome.set(err.status, err.message)
            await client.error(err, self._headers(failed=True))
        except ClientDisconnect:  # while the body was read
            self.outcome.set(CLIENT_CLOSED, "client disconnected")
        except asyncio.CancelledError:
            if not client.gone:  # the server is stopping and the grace period is over
                self.outcome.set(503, "cancelled: the gateway is shutting down")
                if client.started and not self.outcome.answered:  # a stream: say so, never a silent cut
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        async with asyncio.timeout(1):
                            await client.error(_SHUTTING_DOWN, [])
            elif not self.outcome.answered:  # a client that hangs up after [DONE] got its whole answer
                self.outcome.set(CLIENT_CLOSED, "client disconnected")
            raise
        except Exception:  # a bug: still an OpenAI-shaped answer, never a hang
            log.exception("request %s failed", self.rec.request_id)
            internal = APIError(500, "The gateway failed to handle this request.", code="internal_error")
            self.outcome.set(500, internal.message)
            await client.error(internal, self._headers(failed=True))
        finally:
            self._finish()

    async def _serve(self, client: ClientWire) -> None:
        self._identify()
        body = await self._read_body()
        client.watch()  # from here on a client hang-up cancels this exchange, engine legs included
        req = self._parse(body)  # before the queue: a request it must fix never waits for a slot
        await self._admit()
        await self._tokenize(req)
        route = await self._route(req)
        self.decision = route.decision
        legs = EngineLegs(self.rt, self.svc, self.rec, self.account, self.who)
        migrator = self._migrator(req, legs)
        part = self._first_part(route.decision, migrator)
        leg = await legs.open(part)
        relay = AnswerRelay(self.rec, self.outcome, legs, migrator, self._headers, splice=self.rt.cfg.engines.splice)
        await relay.send(client, req, leg)

    @property
    def ctx(self) -> RequestContext:
        assert self.prep is not None, "routed requests only"
        return self.prep.ctx

    # -- before any engine ------------------------------------------------------------------------------

    def _identify(self) -> None:
        """Who is calling (the API key, its tenant and class), in the record and its tenant's account."""
        rt = self.rt
        key = authorize(self.request, rt.api_keys, rt.cfg.limits.max_header_bytes)
        self.who = rt.tenancy.identify(self.request.headers, key)
        self.rec.tenant, self.rec.priority = self.who.tenant, self.who.cls
        self.rec.tenant_label = self.svc.tenant_labels(self.who.tenant)
        self.account = TenantAccount(self.svc.usage, self.who.tenant, rt.cfg.fairness.default_output_tokens)

    async def _read_body(self) -> bytes:
        limit = self.rt.cfg.server.max_body_bytes
        request = self.request
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        # Straight from ASGI ``receive``: Starlette's request.stream() costs ~20 us more per request.
        # A client that stalls its body is cut off (408): no read waits longer than the idle
        # timeout, nor past the whole body's deadline.
        server = self.rt.cfg.server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + server.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout_at(min(deadline, loop.time() + server.body_idle_timeout_s)):
                    message = await request.receive()
            except TimeoutError:
                raise APIError(408, "The request body did not arrive in time.", code="request_timeout") from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _admit(self) -> None:
        adm = self.rt.cfg.admission
        lag = self.svc.lag
        if lag.over(adm.max_loop_lag_ms, adm.overload_hold_s):  # every stream already waits this long for the loop
            self.svc.metrics.rejected("overloaded")
            raise too_busy(adm, f"overloaded: requests wait {lag.behind_s * 1000:.0f} ms before it reads them")
        self._deadline = time.monotonic() + adm.queue_timeout_s
        waited_from = time.perf_counter()
        try:
            admitted = await self.svc.gate.enter(adm.queue_timeout_s, self.who)
        except QueueFull as full:
            self.svc.metrics.rejected(full.why)
            whose = " for this tenant" if "tenant" in full.why else ""
            raise too_busy(adm, f"too many requests waiting{whose}") from None
        if not admitted:
            self.svc.metrics.rejected("queue_timeout")
            raise too_busy(adm, "too many requests in flight")
        self._admitted = self.rec.admitted = True
        if self.account is not None:
            self.account.admitted()
        self.rec.queue_s = time.perf_counter() - waited_from

    async def _understand(self, body: bytes) -> ParsedRequest:
        """Parse, check and tokenize: everything the client must fix is found here."""
        req = self._parse(body)
        await self._tokenize(req)
        return req

    def _parse(self, body: bytes) -> ParsedRequest:
        """The body's fields checked and its model known, which also labels a rejection's metrics
        (a queue timeout is counted under the model asked for, not ``unknown``)."""
        rt, rec = self.rt, self.rec
        t0 = time.perf_counter_ns()
        req = parse_body(body, self.kind)
        served = rt.served(req.model)
        if served is None:
            raise APIError(
                404, f"The model `{clip(req.model, 256)}` does not exist.", param="model", code="model_not_found"
            )
        tok, self.adapter = served
        self.tok = tok
        # metrics are labelled by the base model (bounded); the access log names the adapter
        rec.model, rec.stream = tok.cfg.name, req.stream
        rec.adapter = self.adapter.name if self.adapter is not None else ""
        check_output_limit(req, rt.cfg.limits, tok.cfg.max_model_len)
        fair = rt.cfg.fairness
        if fair.enabled and fair.engine_priority and self.who is not None and self.who.priority:
            req.body["priority"] = self.who.priority  # continuations copy it
            self.rewritten = True
        rec.tokenize_s = (time.perf_counter_ns() - t0) / 1e9  # the tokenizing adds to it
        return req

    async def _tokenize(self, req: ParsedRequest) -> None:
        rt, rec = self.rt, self.rec
        tok = self.tok
        assert tok is not None, "parsed requests only"
        t0 = time.perf_counter_ns()
        prompts = self.prompts = await rt.tokenizers.prompt_ids(tok, req)
        t1 = time.perf_counter_ns()
        rec.tokenize_s = (rec.tokenize_s or 0.0) + (t1 - t0) / 1e9
        rec.prompt_tokens = len(prompts[0])
        if rec.trace.span is not None:
            rec.trace.record("tokenize", t1 - t0, {"pdgate.prompt_tokens": rec.prompt_tokens})
        limit = rt.cfg.limits.max_prompt_tokens
        if limit and (longest := max(map(len, prompts))) > limit:
            raise APIError(
                400,
                f"This gateway accepts prompts of at most {limit} tokens; this one has {longest}.",
                param="messages" if self.kind == "chat" else "prompt",
                code="prompt_too_long",
            )

    async def _route(self, req: ParsedRequest, *, explain: bool = False) -> Route:
        """Hash, look up the prefix index, run the pipeline; waits for engine capacity until the
        admission deadline."""
        rt, rec = self.rt, self.rec
        assert self.prompts is not None
        t1 = time.perf_counter_ns()
        salt = req.body.get("cache_salt")  # vLLM mixes it into the first block's hash
        prep = self.prep = await rt.router.prepare(
            req.model,
            rec.request_id,
            self.prompts[0],
            req.local_only(),
            self.request.headers,
            salt if isinstance(salt, str) else None,
            lora=self.adapter.lora if self.adapter is not None else None,
            loadable=self.adapter is not None and self.adapter.configured and rt.cfg.lora.dynamic_loading,
        )
        route, waited = await self._pick(prep, self._deadline, explain=explain)
        t2 = time.perf_counter_ns()
        rec.route_s = (t2 - t1) / 1e9 - waited
        rec.queue_s += waited
        d = route.decision
        rec.path, rec.reason, rec.decode = d.path.value, d.reason, d.decode.url
        rec.prefill = d.prefill.url if d.prefill else ""
        rec.uncached_tokens = prep.ctx.uncached(d.decode.url)
        if rec.trace.span is not None:
            rec.trace.record("route", t2 - t1, _route_attributes(rec, d, prep, waited))
        return route

    # -- the answer's parts ------------------------------------------------------------------------------

    def _migrator(self, req: ParsedRequest, legs: EngineLegs) -> Migrator:
        """Whether the answer may go on elsewhere (decided before the first engine is asked), and
        what carries it on if it must."""
        assert self.prompts is not None and self.room is not None, "routed requests only"
        return Migrator(
            self.rt,
            self.svc,
            self.rec,
            req,
            self.prompts,
            self.request.headers,
            legs=legs,
            room=self.room,
            parts=self.parts,
        )

    def _first_part(self, decision: Decision, migrator: Migrator) -> Part:
        """The request's own engine request. A migratable one streams from its engine with the
        generated token ids, whatever the client asked: its answer can then go on elsewhere."""
        assert self.prep is not None, "routed requests only"
        body, stream = migrator.engine_request()
        head = migrator.answer.max_event_bytes if migrator.answer is not None else 0
        part = Part(
            0, self.path, body, stream, self.prep, self.rec.request_id, self.rec.trace, decision, max_head_bytes=head
        )
        self.parts.append(part)
        return part

    async def _pick(self, prep: Prepared, deadline: float, *, explain: bool = False) -> tuple[Route, float]:
        """The route, waiting for room on the engines until ``deadline`` (gateway/request/capacity.py);
        a migration's continuation waits in the same ``Room``."""
        if self.room is None:
            self.room = Room(self.rt, self.svc, self.who, self.rec)
        return await self.room.pick(prep, deadline, explain=explain)

    def _headers(self, *, path: Path | None = None, failed: bool = False) -> Headers:
        """The gateway's response headers. ``x-pdgate-path`` only on an answer from an engine: on an
        error no path was completed, and the decided one, maybe abandoned by failover, would mislead."""
        rec = self.rec
        headers = [(b"x-request-id", rec.request_id.encode())]
        if self.prompts is not None:
            headers.append((_TOKENS, str(len(self.prompts[0])).encode()))
            if self.prompts.approximate_reason:
                headers.append((_TOKENS_APPROXIMATE, self.prompts.approximate_reason.encode()))
        d = self.decision
        if d is not None and self.rt.cfg.routing.debug_headers:
            route = f"{d.reason}; {d.detail}; decode={d.decode.url}"
            if d.prefill is not None:
                route += f"; prefill={d.prefill.url}"
            headers.append((_ROUTE, route.encode()))
        if path is not None and not failed:
            headers.append(_PATH[path])
        if rec.failover:
            headers.append((_FAILOVER, ",".join(rec.failover).encode()))
        return headers

    # -- the end ----------------------------------------------------------------------------------------

    def _finish(self) -> None:
        """The one place a request ends: its slot freed, its outcome recorded and told."""
        rec = self.rec
        if self.account is not None:  # before the slot passes on: the next in line is chosen by use
            self.account.ended()
        if self._admitted:
            self.svc.gate.leave()
        if self.decision is None:
            rec.path = "none"  # the gateway answered itself
        settle(rec, self.svc, "abandoned")  # the client left (or the gateway stopped) before the end
        rec.finish(self.outcome.status, self.outcome.error, self.outcome.error_status)
        if self.account is not None:
            self.account.settle(rec.output_tokens)
        if rec.trace.span is not None:
            rec.trace.set({"pdgate.path": rec.path})
            if rec.output_tokens is not None:
                rec.trace.set({"gen_ai.usage.output_tokens": rec.output_tokens})
            if rec.migrations:
                rec.trace.set({"pdgate.migrations": len(rec.migrations)})
        rec.trace.end(rec.status, rec.error)
        self.svc.metrics.record(rec)
        self.svc.access_log.write(rec)
        call_soon = asyncio.get_running_loop().call_soon
        for part in self.parts:
            if part.decision is None:  # routing the continuation failed: its hooks were never told
                continue
            status = self.outcome.error_status or rec.status  # the policies learn that the answer failed
            if part.number == 0:
                result = Finished(status, rec.path, tuple(part.reports), rec.e2e_s, rec.ttft_s, rec.output_tokens)
            else:
                result = Finished(status, part.decision.path.value, tuple(part.reports), rec.e2e_s, continuation=True)
            call_soon(self.rt.hooks.finished, part.ctx, part.decision, result)

    # -- POST /debug/route ------------------------------------------------------------------------------

    async def plan(self) -> dict[str, Any]:
        """What the gateway would do with this body, without sending it or learning from it."""
        self.who = self.rt.tenancy.identify(self.request.headers, None, admin=True)
        body = await self._read_body()
        if self.request.query_params.get("kind") is None:  # a chat body has messages, a completion a prompt
            self.kind = "chat" if b'"messages"' in body else "completion"
        req = await self._understand(body)
        route = await self._route(req, explain=True)
        d, ctx = route.decision, self.ctx
        assert self.prompts is not None and self.prep is not None
        snap = self.svc.pools.snapshot()  # what the policies saw, give or take the time to answer
        return {
            "path": d.path.value,
            "reason": d.reason,
            "detail": d.detail,
            "decode": d.decode.url,
            "prefill": d.prefill.url if d.prefill else None,
            "prompt_tokens": ctx.prompt_tokens,
            "prompt_tokens_approximate": self.prompts.approximate_reason,
            "block_size": self.prep.block_size,
            "blocks": len(self.prep.hashes),
            "cached_tokens": {url: ctx.cached(url) for url in ctx.cached_tokens},
            "settled_tokens": {url: ctx.settled(url) for url in ctx.settled_tokens},
            # with routing.tiers on: each engine's prompt by tier (GPU hit, then L1, then L2 loads)
            "tiers": {url: asdict(hold) for url, hold in sorted((ctx.data.get(TIERS) or {}).items())},
            "predicted_ttft_s": dict(d.predicted_ttft),
            "local_only": ctx.local_only,
            "config_version": self.rt.version,
            "admission": self.room.view() if self.room is not None else {},
            "trace": route.trace,
            "endpoints": [
                {k: sorted(v) if isinstance(v, frozenset) else v for k, v in asdict(e).items()}
                for pool in (snap.prefill, snap.decode)
                for e in pool
            ],
        }


def _route_attributes(rec: RequestRecord, d: Decision, prep: Prepared, waited: float) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "pdgate.path": rec.path,
        "pdgate.reason": rec.reason,
        "pdgate.detail": d.detail,
        "pdgate.decode_endpoint": rec.decode,
        "pdgate.prompt_tokens": rec.prompt_tokens,
        "pdgate.uncached_tokens": rec.uncached_tokens,
        "gen_ai.request.model": rec.model,
        "pdgate.capacity_wait_s": waited,
    }
    if d.prefill is not None:
        attrs["pdgate.prefill_endpoint"] = d.prefill.url
        attrs["pdgate.prefill_uncached_tokens"] = prep.ctx.uncached(d.prefill.url)
    for path, seconds in d.predicted_ttft:  # when the decider predicts (the cost model)
        attrs[f"pdgate.predicted_ttft_{path}_s"] = seconds
    return attrs
