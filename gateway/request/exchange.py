"""One client request from admission to its last byte: the gateway's request path, top to bottom.

    authorize -> read the body -> admission slot -> parse, tokenize -> route
              -> [prefill leg, with failover or fallback to direct] -> decode leg, with failover
              -> relay the answer -> finish: the slot released, the outcome recorded, hooks told

An ``Exchange`` owns everything about its request: the admission slot (released in ``_finish``
only), the ``RequestRecord`` (written here only, read once by metrics and the access log), the
route, both engine legs and their accounting on the endpoints, failover, and the outcome. What the
gateway learns from the request goes out through the lifecycle hooks (``policies.base.Lifecycle``):
``on_routed`` once the route is chosen, ``on_leg_done`` after every engine leg, ``on_finished`` at
the end, each on the event loop's next turn, off the request's critical path. The engine I/O of a
single leg is ``gateway/engines/legs.py``; the client side is ``gateway/request/relay.py``'s ``ClientWire``.

Failover before the client has received a byte: a failed prefill leg is retried on another
prefill engine, then (if allowed) the request goes direct; a decode leg that fails before its
first token is retried on another decode engine. The retry keeps the KV handle only when the
failed engine never saw the request (connection refused): an engine that did see it may have told
the prefill engine to drop the blocks, so the retry goes direct (the decode engine prefills).

After the first token, a migratable request's decode leg that fails is *migrated*: its answer goes
on from the text the client has, on another decode engine, as a new ``_Part`` (the prompt plus the
output kept, routed like a request, so a long one takes the P/D path again). The engine events of
a migratable request are read (gateway/request/stitch.py); every other answer is relayed byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.context import Runtime, Services
from gateway.engines import legs
from gateway.engines.legs import DecodeStream, LegFailed, PrefillAnswer
from gateway.engines.pools import Endpoint
from gateway.engines.transport import ClientError
from gateway.engines.upstream import EngineError, transport_error
from gateway.fairness.accounting import TenantAccount
from gateway.fairness.admission import too_busy
from gateway.fairness.fairqueue import QueueFull
from gateway.fairness.tenants import Identity
from gateway.http.auth import authorize
from gateway.http.errors import APIError, clip
from gateway.ops.requestlog import RequestRecord
from gateway.ops.tracing import RequestTrace
from gateway.request.capacity import Room
from gateway.request.migration import continuation_body, output_budget, resume_point, unmigratable
from gateway.request.protocol import Kind, ParsedRequest, check_output_limit, parse_body, too_large
from gateway.request.relay import DONE, ClientWire
from gateway.request.router import Prepared
from gateway.request.stitch import Answer, Broken, Diverged
from gateway.tokenization.tokenizer import PromptIds
from policies.base import Decision, EndpointView, Finished, LegOutcome, LegReport, Path, RequestContext
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


@dataclass(slots=True)
class _Part:
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

    @property
    def ctx(self) -> RequestContext:
        return self.prep.ctx


@dataclass(slots=True)
class _OpenDecode:
    """A decode leg past its first token (or whole answer), until the relay has sent it on."""

    part: _Part
    stream: DecodeStream
    ep: Endpoint
    path: Path
    started: float
    first_token_s: float | None
    tokens: int  # the gateway's belief: uncached prompt tokens on this engine
    prefill_url: str | None
    span: Any
    occupancy: tuple[str, float] | None = None  # (tenant key, expected output tokens) in its decode use


@dataclass(frozen=True, slots=True)
class _Cut:
    """A decode leg that failed after its first token: why (a metric label) and what the client
    gets if the answer cannot go on."""

    reason: str
    err: APIError


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
        self.decision: Decision | None = None
        self.parts: list[_Part] = []  # the request's own, then one per migration
        self.answer: Answer | None = None  # a migratable request's answer (its events are read)
        self.unmigratable: str | None = None  # else why not
        self.status = 0
        self.error = ""
        self.error_status: int | None = None  # a stream's error event, after its 200 went out
        self._admitted = False
        self._answered = False  # the client has the whole answer (an SSE stream through [DONE])
        self._deadline = 0.0  # admission and engine capacity are waited for until then
        self._failed_decode: set[str] = set()  # decode engines whose leg broke off mid-answer
        self.who: Identity | None = None  # tenant, class, objective
        self.account: TenantAccount | None = None  # its charges to its tenant's use of each pool
        self.room: Room | None = None  # its wait for room on the engines (and TTFT objective's check)

    # -- the request path -----------------------------------------------------------------------------

    async def run(self, client: ClientWire) -> None:
        """Serve the request; returns once the client has its answer (or is gone). Never raises
        but for cancellation (the client left, or the server is stopping)."""
        try:
            await self._serve(client)
        except APIError as err:
            self._outcome(err.status, err.message)
            await client.error(err, self._headers(failed=True))
        except ClientDisconnect:  # while the body was read
            self._outcome(CLIENT_CLOSED, "client disconnected")
        except asyncio.CancelledError:
            if not client.gone:  # the server is stopping and the grace period is over
                self._outcome(503, "cancelled: the gateway is shutting down")
                if client.started and not self._answered:  # a stream: say so, never a silent cut
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        async with asyncio.timeout(1):
                            await client.error(_SHUTTING_DOWN, [])
            elif not self._answered:  # a client that hangs up after [DONE] got its whole answer
                self._outcome(CLIENT_CLOSED, "client disconnected")
            raise
        except Exception:  # a bug: still an OpenAI-shaped answer, never a hang
            log.exception("request %s failed", self.rec.request_id)
            internal = APIError(500, "The gateway failed to handle this request.", code="internal_error")
            self._outcome(500, internal.message)
            await client.error(internal, self._headers(failed=True))
        finally:
            self._finish()

    async def _serve(self, client: ClientWire) -> None:
        rt = self.rt
        key = authorize(self.request, rt.api_keys, rt.cfg.limits.max_header_bytes)
        self.who = rt.tenancy.identify(self.request.headers, key)
        self.rec.tenant, self.rec.priority = self.who.tenant, self.who.cls
        self.rec.tenant_label = self.svc.tenant_labels(self.who.tenant)
        self.account = TenantAccount(self.svc.usage, self.who.tenant, rt.cfg.fairness.default_output_tokens)
        body = await self._read_body()
        client.watch()  # from here on a client hang-up cancels this exchange, engine legs included
        req = self._parse(body)  # before the queue: a request it must fix never waits for a slot
        await self._admit()
        await self._tokenize(req)
        route = await self._route(req)
        decision = self.decision = route.decision
        part = self._first_part(req, decision)
        asyncio.get_running_loop().call_soon(self._routed, part)  # off the critical path
        handle = await self._prefill(part, decision) if decision.path is Path.PD else None
        leg = await self._decode(part, decision, handle)
        await self._relay(client, req, leg)

    @property
    def ctx(self) -> RequestContext:
        assert self.prep is not None, "routed requests only"
        return self.prep.ctx

    # -- before any engine ------------------------------------------------------------------------------

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
        if lag.over(adm.max_loop_lag_ms):  # every stream already waits this long for the loop
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
        tok = rt.tokenizers.get(req.model)
        if tok is None:
            raise APIError(
                404, f"The model `{clip(req.model, 256)}` does not exist.", param="model", code="model_not_found"
            )
        rec.model, rec.stream = req.model, req.stream
        check_output_limit(req, rt.cfg.limits, tok.cfg.max_model_len)
        fair = rt.cfg.fairness
        if fair.enabled and fair.engine_priority and self.who is not None and self.who.priority:
            req.body["priority"] = self.who.priority  # continuations copy it
        rec.tokenize_s = (time.perf_counter_ns() - t0) / 1e9  # the tokenizing adds to it
        return req

    async def _tokenize(self, req: ParsedRequest) -> None:
        rt, rec = self.rt, self.rec
        tok = rt.tokenizers.get(req.model)
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

    def _first_part(self, req: ParsedRequest, decision: Decision) -> _Part:
        """The request's own engine request. A migratable one streams from its engine with the
        generated token ids, whatever the client asked: its answer can then go on elsewhere."""
        assert self.prep is not None and self.prompts is not None
        body, stream = req.body, req.stream
        migration = self.rt.cfg.routing.migration
        why = unmigratable(req, self.prompts.approximate_reason) if migration.enabled else "disabled"
        if why is None and not (stream or migration.non_streaming):
            why = "non_streaming"
        if why is None and migration.max_per_request > 0:
            opts = body.get("stream_options") or {}
            max_model_len = self.rt.tokenizers.get(req.model).cfg.max_model_len  # type: ignore[union-attr]
            self.answer = Answer(
                req.kind,
                stream=req.stream,
                wants_ids=bool(body.get("return_token_ids")),
                usage=bool(opts.get("include_usage")),
                continuous=bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
                prompt=self.prompts[0],
                # the role chunk: the prompt's ids, and its text if asked for (escaped)
                max_event_bytes=(1 << 16) + 12 * max_model_len + 6 * req.raw_size,
            )
            body = {**body, "return_token_ids": True}
            if not stream:
                body.update(stream=True, stream_options={"include_usage": True})
                stream = True
        else:
            self.unmigratable = why or "limit"
        part = _Part(0, self.path, body, stream, self.prep, self.rec.request_id, self.rec.trace, decision)
        self.parts.append(part)
        return part

    async def _pick(
        self,
        prep: Prepared,
        deadline: float,
        *,
        explain: bool = False,
        exclude: Collection[str] = (),
        sheddable: bool = True,
    ) -> tuple[Route, float]:
        """The route, waiting for room on the engines until ``deadline`` (gateway/request/capacity.py)."""
        if self.room is None:
            self.room = Room(self.rt, self.svc, self.who, self.rec)
        return await self.room.pick(prep, deadline, explain=explain, exclude=exclude, sheddable=sheddable)

    # -- the engine legs --------------------------------------------------------------------------------

    async def _prefill(self, part: _Part, decision: Decision) -> PrefillAnswer | None:
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

    async def _prefill_leg(self, part: _Part, ep: Endpoint) -> PrefillAnswer:
        rec = self.rec
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

    async def _decode(self, part: _Part, decision: Decision, handle: PrefillAnswer | None) -> _OpenDecode:
        """Step 3 up to its first token, on the chosen decode engine, else another one."""
        ep, retries = self.svc.pools.get(decision.decode), self.rt.cfg.failover.decode_retries
        tried = {ep.url, *self._failed_decode}
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

    async def _decode_leg(self, part: _Part, ep: Endpoint, handle: PrefillAnswer | None) -> _OpenDecode:
        """A direct stream prefills its uncached tokens on the engine first: they count in its
        backlog until the first token (the cost model's queue estimate); a whole answer's first
        token cannot be seen, so non-streamed legs do not count."""
        rec = self.rec
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
            head_bytes = self.answer.max_event_bytes if self.answer is not None else 0
            stream = await legs.open_decode(
                self.rt.upstream,
                ep,
                part.path,
                body,
                part.request_id,
                part.stream,
                span.headers,
                max_head_bytes=head_bytes,
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
        return _OpenDecode(part, stream, ep, path, started, first, tokens, prefill_url, span, occupancy)

    def _occupy(self, part: _Part) -> tuple[str, float] | None:
        """The decode leg in its tenant's decode use (gateway/fairness/accounting.py)."""
        return self.account.decode_started(part.body) if self.account is not None else None

    def _vacate(self, occupancy: tuple[str, float] | None) -> None:
        if occupancy is not None and self.account is not None:
            self.account.decode_ended(occupancy)

    # -- the answer -------------------------------------------------------------------------------------

    async def _relay(self, client: ClientWire, req: ParsedRequest, leg: _OpenDecode) -> None:
        """Send the decode engine's answer on as it comes. The engine has the prompt's KV from here
        on (it answered), so a stream that breaks off, or a client that leaves, is a ``cut`` leg."""
        rec, resp = self.rec, leg.stream.resp
        rec.path = leg.path.value
        headers = self._headers(path=leg.path)
        content_type = resp.header(b"content-type") or b"application/json"
        if self.answer is not None and _is_stream(content_type):
            # a stream for a streaming client; assembled into JSON for one that did not ask to stream
            headers.append((b"content-type", content_type if req.stream else b"application/json"))
            await self._relay_answer(client, req, leg, headers, self.answer)
            return
        headers.append((b"content-type", content_type))
        outcome, clean = LegOutcome.CUT, False
        try:
            if not req.stream:
                # (a migratable request's engine that answered a whole body although asked to stream)
                body = leg.stream.head if leg.part.stream == req.stream else leg.stream.head + await resp.read()
                self._outcome(resp.status)
                await client.whole(resp.status, headers, body)
                self._answered = True
                rec.sent_body(body)
                outcome = LegOutcome.OK
                clean = True
                return
            self._outcome(resp.status)
            await client.start(resp.status, headers)
            chunk, send, read = leg.stream.head, client.asgi_send, resp.read_some
            try:
                while chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    rec.sent_chunk(chunk)
                    if chunk.endswith(DONE):
                        self._answered = True
                        outcome = LegOutcome.OK  # whatever happens to the connection now
                    chunk = await read()
            except (TimeoutError, ClientError) as err:
                if self._answered:  # the engine broke off after [DONE]: the answer is whole
                    await client.end()
                    return
                # Headers are gone already: an error event and [DONE], as vLLM ends a failed stream.
                cut = transport_error(err, "decode")
                self._not_migrated(_Cut(_reason(err), cut), self.unmigratable or "disabled")
                self._broke_off(cut)
                await client.error(cut, [])
                return
            await client.end()
            outcome = LegOutcome.OK
            clean = True
        finally:
            self._leg_end(leg, outcome, clean, resp.status, rec.cached_tokens)

    async def _relay_answer(
        self,
        client: ClientWire,
        req: ParsedRequest,
        leg: _OpenDecode,
        headers: list[tuple[bytes, bytes]],
        answer: Answer,
    ) -> None:
        """A migratable answer: each engine event read, the client's written; a decode leg that
        fails mid-way is continued on another engine, as often as the config allows."""
        if req.stream:
            self._outcome(200)
            try:
                await client.start(200, headers)
            except BaseException:  # the client left: the leg ends here (its slot, its tenant's use)
                self._leg_end(leg, LegOutcome.CUT, False, leg.stream.resp.status, None)
                raise
        while True:
            cut = await self._relay_part(client, leg, answer)
            if cut is None:
                break
            if answer.finish is not None:  # all there but its end: the usage chunk, [DONE]
                log.info(
                    "request %s: the decode engine's stream broke after its finish reason (%s); the gateway ends it",
                    self.rec.request_id,
                    cut.reason,
                )
                if req.stream:
                    await client.send(answer.close())
                break
            opened = await self._migrate(req, leg, cut, answer)
            if opened is None:
                self.rec.output_tokens = answer.output_tokens  # what the client got before the error
                if req.stream:
                    self._broke_off(cut.err)
                else:
                    self._outcome(cut.err.status, cut.err.message)
                await client.error(cut.err, [] if req.stream else self._headers(failed=True))
                return
            leg = opened
        for m in self.rec.migrations:
            if m["result"] == "pending":
                m["result"] = "ok"
                self.svc.metrics.migration(m["reason"], "ok")
        self.rec.output_tokens = answer.output_tokens
        if req.stream:
            await client.end()
        else:
            body = answer.whole()
            self._outcome(200)
            await client.whole(200, headers, body)
            self.rec.sent_body(body)
        self._answered = True

    async def _relay_part(self, client: ClientWire, leg: _OpenDecode, answer: Answer) -> _Cut | None:
        """One part of a migratable answer, until it is whole (None) or breaks off (the cut)."""
        rec, resp = self.rec, leg.stream.resp
        outcome, clean, cut = LegOutcome.CUT, False, None
        chunk, send, read = leg.stream.head, client.asgi_send, resp.read_some
        try:
            while chunk:
                out = answer.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    rec.sent_chunk(out)
                answer.check()
                if answer.done:  # whatever happens to the connection now
                    outcome = LegOutcome.OK
                    self._answered = answer.stream  # [DONE] is out: a hang-up now changes nothing
                chunk = await read()
            answer.ended()
            outcome, clean = LegOutcome.OK, True
        except (TimeoutError, ClientError) as err:
            if answer.done:  # the engine broke off after [DONE]: the answer is whole
                outcome = LegOutcome.OK
            else:
                cut = _Cut(_reason(err), transport_error(err, "decode"))
        except Broken as err:
            cut = _Cut(err.cause, EngineError(502, f"The decode engine failed: {err}.", code="engine_error"))
        except Diverged as err:
            log.warning("request %s: %s", self.rec.request_id, err)
            cut = _Cut("diverged", EngineError(502, "The decode engine failed mid-answer.", code="engine_error"))
        finally:
            self._leg_end(leg, outcome, clean, resp.status, answer.cached_tokens)
        return cut

    def _leg_end(self, leg: _OpenDecode, outcome: LegOutcome, clean: bool, status: int, cached: int | None) -> None:
        """``cached``: the engine's own count of prompt tokens its cache served (its usage)."""
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

    # -- migration --------------------------------------------------------------------------------------

    async def _migrate(self, req: ParsedRequest, failed: _OpenDecode, cut: _Cut, answer: Answer) -> _OpenDecode | None:
        """Continue the answer on another decode engine: the prompt plus the output kept, routed
        like a request. None when it cannot (the reason is logged and counted)."""
        self._failed_decode.add(failed.ep.url)
        for m in self.rec.migrations:  # an earlier migration's continuation failed too
            if m["result"] == "pending":
                m["result"] = "failed"
                self.svc.metrics.migration(m["reason"], "failed")
        why = self._why_not(cut, answer)
        if why is not None:
            self._not_migrated(cut, why)
            return None
        t0 = time.perf_counter()
        record: dict[str, Any] = {
            "reason": cut.reason,
            "from": failed.ep.url,
            "to": None,
            "path": None,
            "tokens": 0,
            "result": "pending",
        }
        self.rec.migrations.append(record)
        span, trace = self.rec.trace.child(
            "migration", {"pdgate.migration.reason": cut.reason, "pdgate.migration.from": failed.ep.url}
        )
        try:
            part = await self._continuation(req, answer, trace)
            record["tokens"] = kept = answer.output_tokens
            span.set("pdgate.migration.kept_tokens", kept)
            if part is None:
                why = "no_resume_point"
                log.warning(
                    "request %s: not migrated (%s): the text sent does not join the tokens received",
                    self.rec.request_id,
                    why,
                )
                record["result"] = "skipped"
                self.svc.metrics.migration(cut.reason, "skipped", why)
                span.end(why)
                return None
            log.warning(
                "request %s: decode leg on %s failed mid-answer (%s); continuing after %d tokens",
                self.rec.request_id,
                failed.ep.url,
                cut.reason,
                kept,
            )
            deadline = time.monotonic() + self.rt.cfg.admission.queue_timeout_s
            route, _ = await self._pick(part.prep, deadline, exclude=self._failed_decode, sheddable=False)
            decision = part.decision = route.decision
            asyncio.get_running_loop().call_soon(self._routed, part)
            handle = await self._prefill(part, decision) if decision.path is Path.PD else None
            leg = await self._decode(part, decision, handle)
        except APIError as err:
            log.warning("request %s: migration failed: %s", self.rec.request_id, err)
            record["result"] = "failed"
            self.svc.metrics.migration(cut.reason, "failed")
            span.end(str(err))
            return None
        except BaseException:
            span.end("abandoned")
            raise
        seconds = time.perf_counter() - t0
        record.update(to=leg.ep.url, path=leg.path.value, ms=round(seconds * 1000, 3))
        span.set("pdgate.migration.to", leg.ep.url)
        span.set("pdgate.migration.path", leg.path.value)
        span.end()
        self.svc.metrics.migrated(self.rec.model, leg.path.value, kept, seconds)
        return leg

    def _why_not(self, cut: _Cut, answer: Answer) -> str | None:
        migration = self.rt.cfg.routing.migration
        if cut.reason == "diverged":
            return "diverged"
        if answer.unresumable is not None:
            return answer.unresumable
        if not answer.prompt_confirmed and self.prompts is not None and self.prompts.approximate_reason:
            return "prompt_unknown"  # the gateway's count may be off and the engine did not say its own
        if sum(1 for m in self.rec.migrations if m["result"] != "skipped") >= migration.max_per_request:
            return "limit"
        if migration.deadline_s and self.rec.since_start() > migration.deadline_s:
            return "deadline"
        return None

    def _not_migrated(self, cut: _Cut, why: str) -> None:
        log.warning(
            "request %s: decode leg failed mid-answer (%s); not migrated: %s", self.rec.request_id, cut.reason, why
        )
        self.rec.migrations.append({"reason": cut.reason, "result": "skipped", "why": why})
        self.svc.metrics.migration(cut.reason, "skipped", why)

    async def _continuation(self, req: ParsedRequest, answer: Answer, trace: RequestTrace) -> _Part | None:
        """The next part: where the answer resumes (None: nowhere safe), its body and context."""
        tok = self.rt.tokenizers.get(req.model)
        assert tok is not None
        prompt = answer.prompt()
        budget = output_budget(req)
        point = await self.rt.tokenizers.run(
            resume_point,
            tok.backend,
            prompt,
            answer.ids,
            answer.text_len,
            answer.tail(answer.tail_chars),
            skip_special_tokens=req.body.get("skip_special_tokens") is not False,
            spaces_between_special_tokens=req.body.get("spaces_between_special_tokens") is not False,
            max_tokens=budget,
        )
        if point is None:
            return None
        if answer.prompt_mismatch:
            log.warning(
                "request %s: the engine's prompt token ids differ from the gateway's (%d vs %d tokens); "
                "the continuation uses the engine's",
                self.rec.request_id,
                answer.prompt_tokens,
                len(self.prompts[0]) if self.prompts else 0,
            )
        answer.resume(point.tokens, point.overlap)
        ids = [*prompt, *answer.ids]
        body = continuation_body(
            req, ids, point.tokens, max_model_len=tok.cfg.max_model_len, continuous=answer.continuous
        )
        number = len(self.parts)
        request_id = f"{self.rec.request_id}-m{number}"
        salt = req.body.get("cache_salt")
        prep = await self.rt.router.prepare(
            req.model, request_id, ids, None, self.request.headers, salt if isinstance(salt, str) else None
        )
        part = _Part(number, "/v1/completions", body, True, prep, request_id, trace)
        self.parts.append(part)
        return part

    def _headers(self, *, path: Path | None = None, failed: bool = False) -> list[tuple[bytes, bytes]]:
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

    # -- bookkeeping ------------------------------------------------------------------------------------

    def _other(self, part: _Part, pool: str, exclude: set[str], paired: EndpointView | None = None) -> Endpoint | None:
        return self.rt.router.other(part.prep, pool, exclude, paired)

    def _failover(self, event: str, err: APIError, ep: Endpoint) -> None:
        cause = err.code or "engine_error"
        self.rec.failover.append(event)
        self.rec.trace.event(event, {"pdgate.cause": cause, "pdgate.failed_endpoint": ep.url})
        self.svc.metrics.failover(event, cause)

    def _routed(self, part: _Part) -> None:
        assert part.decision is not None
        self.rt.hooks.routed(part.ctx, part.decision)
        if part.number == 0:  # a continuation's route is counted with its migration
            self.svc.metrics.decided(part.decision.path.value, part.decision.reason)

    def _leg_done(self, part: _Part, report: LegReport) -> None:
        part.reports.append(report)
        asyncio.get_running_loop().call_soon(self.rt.hooks.leg_done, part.ctx, report)

    def _outcome(self, status: int, error: str = "") -> None:
        self.status, self.error = status, error

    def _broke_off(self, err: APIError) -> None:
        """A stream failed after its 200 went out: the client got that status and an error event;
        the record keeps both (an access log that said 502 would not be what the client saw)."""
        self.error, self.error_status = err.message, err.status

    def _finish(self) -> None:
        """The one place a request ends: its slot freed, its outcome recorded and told."""
        rec = self.rec
        if self.account is not None:  # before the slot passes on: the next in line is chosen by use
            self.account.ended()
        if self._admitted:
            self.svc.gate.leave()
        if self.decision is None:
            rec.path = "none"  # the gateway answered itself
        for m in rec.migrations:
            if m["result"] == "pending":  # the client left (or the gateway stopped) before the end
                m["result"] = "abandoned"
                self.svc.metrics.migration(m["reason"], "abandoned")
        rec.finish(self.status, self.error, self.error_status)
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
            status = self.error_status or rec.status  # the policies learn that the answer failed
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


def _failed(failed: LegFailed) -> LegOutcome:
    if not failed.reached:
        return LegOutcome.UNREACHED
    return LegOutcome.REJECTED if 400 <= failed.err.status < 500 else LegOutcome.FAILED


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


def _is_stream(content_type: bytes | None) -> bool:
    return content_type is not None and content_type.startswith(b"text/event-stream")


def _reason(err: BaseException) -> str:
    """A broken decode connection as a migration reason."""
    return "timeout" if isinstance(err, TimeoutError) else "disconnected"
