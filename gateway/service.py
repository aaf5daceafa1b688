"""The request path, top to bottom: read, check, tokenize, decide, dispatch, relay."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from policies.pipeline import NoEndpointError

from .admission import Gate, too_busy
from .config import GatewayConfig
from .dispatch import DecodeStream, Dispatcher
from .errors import APIError, error_response
from .metrics import GatewayMetrics
from .pools import Pools
from .protocol import Kind, ParsedRequest, check_output_limit, parse_body, too_large
from .relay import Outcome, RelayResponse
from .requestlog import AccessLog, RequestRecord
from .router import Prepared, Router, Saturated
from .tokenizer import PromptIds, Tokenizers
from .tracing import Tracing

log = logging.getLogger(__name__)

PATH_HEADER = "x-pdgate-path"
TOKENS_HEADER = "x-pdgate-prompt-tokens"  # the gateway's own count, comparable with usage.prompt_tokens
ROUTE_HEADER = "x-pdgate-route"  # with routing.debug_headers: reason, numbers, endpoints

_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(client_id: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (vLLM builds its response ids from it and
    suffixes its internal ids, so reuse cannot collide inside an engine), else a fresh one."""
    if client_id and _SAFE_ID.fullmatch(client_id):
        return client_id
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Runtime:
    """Everything one config version decides; a reload swaps it whole, between requests (a request
    keeps the runtime it started with)."""

    cfg: GatewayConfig
    version: str
    router: Router
    dispatcher: Dispatcher
    tokenizers: Tokenizers
    api_keys: tuple[bytes, ...] = ()  # empty: no key needed


@dataclass(frozen=True)
class Routed:
    req: ParsedRequest
    prompts: PromptIds
    prep: Prepared
    route: Any  # policies.pipeline.Route


class Gateway:
    """The OpenAI endpoints; every dependency is handed in, so tests can swap any of them."""

    def __init__(self, runtime: Runtime, pools: Pools, metrics: GatewayMetrics, tracing: Tracing | None = None,
                 access_log: AccessLog | None = None) -> None:
        self.runtime = runtime
        self.pools = pools
        self.metrics = metrics
        self.tracing = tracing or Tracing(runtime.cfg.telemetry.tracing)
        self.access_log = access_log or AccessLog(enabled=False)
        self.gate = Gate(runtime.cfg.admission.max_in_flight)
        self.admin_token: str | None = None  # admin and debug endpoints are off without one
        self.watcher: Any = None  # the config watcher, when the config comes from a file
        self.feeds: Callable[[], list[Any]] = list  # the KV event subscribers
        self.shared: Any = None  # the Redis shared state, when configured
        self.discovery: Any = None  # the Kubernetes EndpointSlice watchers, when any pool uses them

    async def chat(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "completion", "/v1/completions")

    def authorize(self, request: Request) -> None:
        """Raises 431 for oversized headers, 401 without a valid API key (when keys are configured)."""
        rt = self.runtime
        if sum(len(k) + len(v) for k, v in request.scope["headers"]) > rt.cfg.limits.max_header_bytes:
            raise APIError(431, f"Request headers exceed {rt.cfg.limits.max_header_bytes} bytes.",
                           code="headers_too_large")
        if not rt.api_keys:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip().encode() if given[:7].lower() == "bearer " else b""
        # Compare with every key, without stopping at a match: the time taken says nothing.
        if not sum(hmac.compare_digest(token, key) for key in rt.api_keys):
            raise APIError(401, "Incorrect API key provided.", type_="invalid_request_error", code="invalid_api_key")

    async def _route(self, rt: Runtime, request: Request, kind: Kind, rec: RequestRecord, *,
                     explain: bool = False, deadline: float | None = None) -> Routed:
        """Read, check, tokenize and decide (waiting for engine capacity until ``deadline``); raises
        APIError for anything the client must fix or wait for."""
        body = await self._read_body(request, rt.cfg.server.max_body_bytes)
        t0 = time.perf_counter_ns()
        req = parse_body(body, kind)
        tok = rt.tokenizers.get(req.model)
        if tok is None:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
        rec.model, rec.stream = req.model, req.stream
        check_output_limit(req, rt.cfg.limits.max_output_tokens)
        prompts = await rt.tokenizers.prompt_ids(tok, req)
        t1 = time.perf_counter_ns()
        rec.tokenize_s = (t1 - t0) / 1e9
        rec.prompt_tokens = len(prompts[0])
        if rec.trace.span is not None:
            rec.trace.record("tokenize", t1 - t0, {"pdgate.prompt_tokens": rec.prompt_tokens})
        limit = rt.cfg.limits.max_prompt_tokens
        if limit and (longest := max(map(len, prompts))) > limit:
            raise APIError(400, f"This gateway accepts prompts of at most {limit} tokens; this one has "
                           f"{longest}.", param="messages" if kind == "chat" else "prompt",
                           code="prompt_too_long")
        salt = req.body.get("cache_salt")  # vLLM mixes it into the first block's hash
        prep = await rt.router.prepare(req.model, rec.request_id, prompts[0], req.local_only(), request.headers,
                                       salt if isinstance(salt, str) else None)
        adm = rt.cfg.admission
        waited = 0.0
        while True:
            try:
                route = rt.router.route(prep, explain=explain, max_decode=adm.max_per_decode_endpoint,
                                        max_prefill=adm.max_per_prefill_endpoint)
                break
            except NoEndpointError:
                raise APIError(503, "No decode engine is available right now.", code="no_healthy_endpoint",
                               type_="server_error") from None
            except Saturated:
                left = (deadline or 0.0) - time.monotonic()
                if explain or left <= 0:
                    raise too_busy(adm, "every decode engine is at its limit") from None
                w0 = time.perf_counter()
                await self.pools.wait_release(left)
                waited += time.perf_counter() - w0
        t2 = time.perf_counter_ns()
        rec.route_s = (t2 - t1) / 1e9 - waited
        rec.queue_s += waited
        d = route.decision
        rec.path, rec.reason, rec.decode = d.path.value, d.reason, d.decode.url
        rec.prefill = d.prefill.url if d.prefill else ""
        rec.uncached_tokens = prep.ctx.uncached(d.decode.url)
        if rec.trace.span is not None:
            rec.trace.record("route", t2 - t1, _route_attributes(rec, d, prep, waited))
        return Routed(req, prompts, prep, route)

    async def _handle(self, request: Request, kind: Kind, path: str) -> Response | RelayResponse:
        rt = self.runtime
        rec = RequestRecord(_request_id(request.headers.get("x-request-id")), kind)
        rec.trace = self.tracing.start(f"POST {path}", request.headers, {"url.path": path})
        if rec.trace.span is not None:
            rec.trace.set({"http.request.method": "POST", "pdgate.request_id": rec.request_id})
        admitted = False
        try:
            self.authorize(request)
            adm = rt.cfg.admission
            deadline = time.monotonic() + adm.queue_timeout_s
            if not await self.gate.enter(adm.queue_timeout_s):
                raise too_busy(adm, "too many requests in flight")
            admitted = rec.admitted = True
            rec.queue_s = rec.since_start()
            r = await self._route(rt, request, kind, rec, deadline=deadline)
        except APIError as err:
            self._refuse(rec, admitted, err.status, err.message)
            return error_response(err)
        except ClientDisconnect:
            self._refuse(rec, admitted, 499, "client disconnected")
            return Response(status_code=499)
        except Exception:  # a bug: answer in the OpenAI shape and keep the count honest
            log.exception("request handling failed")
            err = APIError(500, "The gateway failed to handle this request.", code="internal_error")
            self._refuse(rec, admitted, 500, err.message)
            return error_response(err)
        except BaseException:  # cancelled (the server is stopping): the slot must not leak
            self._refuse(rec, admitted, 503, "cancelled: the gateway is shutting down")
            raise

        decision = r.route.decision
        # Bookkeeping that the answer does not wait for runs once the engine leg is on its way
        # (the loop's next turn: the first wait for the engine), off the request's critical path.
        asyncio.get_running_loop().call_soon(self._decided, rt, r)

        def done(outcome: Outcome) -> None:
            self.gate.leave()
            rec.path = outcome.path or rec.path
            rec.finish(outcome.status, outcome.error)
            self._finished(rec)

        headers = {PATH_HEADER: decision.path.value, "x-request-id": rec.request_id,
                   TOKENS_HEADER: str(len(r.prompts[0]))}
        if r.prompts.approximate_reason:
            headers[TOKENS_HEADER + "-approximate"] = r.prompts.approximate_reason
        if rt.cfg.routing.debug_headers:
            headers[ROUTE_HEADER] = (f"{decision.reason}; {decision.detail}; decode={decision.decode.url}"
                                     + (f"; prefill={decision.prefill.url}" if decision.prefill else ""))
        prefill_tokens = r.prep.ctx.uncached(decision.prefill.url) if decision.prefill else 0

        async def start() -> DecodeStream:
            up = await rt.dispatcher.run(decision, r.req, path, rec,
                                         lambda pool, exclude: rt.router.other(r.prep, pool, exclude),
                                         prefill_tokens, rec.uncached_tokens)
            if r.req.stream:  # the path really taken (failover may change it) labels its tokens' gaps
                rec.itl = self.metrics.itl_for(rec.model, up.path.value)
            return up

        return RelayResponse(
            start=start,
            stream=r.req.stream,
            headers=headers,
            on_done=done,
            record=rec,
        )

    def _decided(self, rt: Runtime, r: Routed) -> None:
        rt.router.learn(r.prep, r.route)
        d = r.route.decision
        self.metrics.decided(d.path.value, d.reason)

    async def explain(self, request: Request) -> dict[str, Any]:
        """What the gateway would do with this body (``POST /debug/route``), without sending it."""
        rt = self.runtime
        kind = request.query_params.get("kind")
        if kind is None:  # a chat body has messages, a completion body a prompt
            kind = "chat" if b'"messages"' in await request.body() else "completion"
        if kind not in ("chat", "completion"):
            raise APIError(400, "kind must be 'chat' or 'completion'.", param="kind")
        rec = RequestRecord(_request_id(request.headers.get("x-request-id")), kind)  # type: ignore[arg-type]
        r = await self._route(rt, request, kind, rec, explain=True)  # type: ignore[arg-type]
        d, ctx = r.route.decision, r.prep.ctx
        snap = self.pools.snapshot()  # what the policies saw, give or take the time to answer
        return {
            "path": d.path.value,
            "reason": d.reason,
            "detail": d.detail,
            "decode": d.decode.url,
            "prefill": d.prefill.url if d.prefill else None,
            "prompt_tokens": ctx.prompt_tokens,
            "prompt_tokens_approximate": r.prompts.approximate_reason,
            "block_size": r.prep.block_size,
            "blocks": len(r.prep.hashes),
            "cached_tokens": {url: ctx.cached(url) for url in ctx.cached_tokens},
            "local_only": ctx.local_only,
            "config_version": rt.version,
            "trace": r.route.trace,
            "endpoints": [asdict(v) for pool in (snap.prefill, snap.decode) for v in pool],
        }

    async def _read_body(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        cached = getattr(request, "_body", None)  # already read (POST /debug/route peeks at it)
        if cached is not None:
            if len(cached) > limit:
                raise too_large(limit)
            return cached
        # Straight from ASGI ``receive``: Starlette's request.stream() costs ~20 us more per request.
        chunks, size = [], 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _refuse(self, rec: RequestRecord, admitted: bool, status: int, error: str) -> None:
        """Answered by the gateway itself (no engine): count it, free the admission slot."""
        if admitted:
            self.gate.leave()
        rec.path = "none"
        rec.finish(status, error)
        self._finished(rec)

    def _finished(self, rec: RequestRecord) -> None:
        if rec.trace.span is not None:
            rec.trace.set({"pdgate.path": rec.path})
            if rec.output_tokens is not None:
                rec.trace.set({"gen_ai.usage.output_tokens": rec.output_tokens})
        rec.trace.end(rec.status, rec.error)
        self.metrics.record(rec)
        self.access_log.write(rec)


def _route_attributes(rec: RequestRecord, d: Any, prep: Prepared, waited: float) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "pdgate.path": rec.path, "pdgate.reason": rec.reason, "pdgate.detail": d.detail,
        "pdgate.decode_endpoint": rec.decode, "pdgate.prompt_tokens": rec.prompt_tokens,
        "pdgate.uncached_tokens": rec.uncached_tokens, "gen_ai.request.model": rec.model,
        "pdgate.capacity_wait_s": waited,
    }
    if rec.prefill:
        attrs["pdgate.prefill_endpoint"] = rec.prefill
        attrs["pdgate.prefill_uncached_tokens"] = prep.ctx.uncached(rec.prefill)
    for path, seconds in d.predicted_ttft:  # when the decider predicts (the cost model)
        attrs[f"pdgate.predicted_ttft_{path}_s"] = seconds
    return attrs
