"""The request path, top to bottom: read, check, tokenize, decide, dispatch, relay."""

from __future__ import annotations

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

from .config import GatewayConfig
from .dispatch import Dispatcher
from .errors import APIError, error_response
from .metrics import GatewayMetrics
from .pools import Pools
from .protocol import Kind, ParsedRequest, parse_body, too_large
from .relay import Outcome, RelayResponse
from .router import Prepared, Router
from .tokenizer import PromptIds, Tokenizers

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


@dataclass(frozen=True)
class Routed:
    req: ParsedRequest
    prompts: PromptIds
    request_id: str
    prep: Prepared
    route: Any  # policies.pipeline.Route


class Gateway:
    """The OpenAI endpoints; every dependency is handed in, so tests can swap any of them."""

    def __init__(self, runtime: Runtime, pools: Pools, metrics: GatewayMetrics) -> None:
        self.runtime = runtime
        self.pools = pools
        self.metrics = metrics
        self.admin_token: str | None = None  # admin and debug endpoints are off without one
        self.watcher: Any = None  # the config watcher, when the config comes from a file
        self.feeds: Callable[[], list[Any]] = list  # the KV event subscribers
        self.shared: Any = None  # the Redis shared state, when configured

    async def chat(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "completion", "/v1/completions")

    async def _route(self, rt: Runtime, request: Request, kind: Kind, *, explain: bool = False) -> Routed:
        """Read, check, tokenize and decide; raises APIError for anything the client must fix."""
        req = parse_body(await self._read_body(request, rt.cfg.server.max_body_bytes), kind)
        tok = rt.tokenizers.get(req.model)
        if tok is None:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
        prompts = await rt.tokenizers.prompt_ids(tok, req)
        request_id = _request_id(request.headers.get("x-request-id"))
        salt = req.body.get("cache_salt")  # vLLM mixes it into the first block's hash
        prep = await rt.router.prepare(req.model, request_id, prompts[0], req.local_only(), request.headers,
                                 salt if isinstance(salt, str) else None)
        try:
            route = rt.router.route(prep, explain=explain)
        except NoEndpointError:
            raise APIError(503, "No decode engine is available right now.", code="no_healthy_endpoint",
                           type_="server_error") from None
        return Routed(req, prompts, request_id, prep, route)

    async def _handle(self, request: Request, kind: Kind, path: str) -> Response | RelayResponse:
        started = time.perf_counter()
        rt = self.runtime
        model = "unknown"
        try:
            r = await self._route(rt, request, kind)
            model = r.req.model  # only configured names become metric labels
        except APIError as err:
            self._count(model, "none", err.status, started)
            return error_response(err)
        except ClientDisconnect:
            self._count(model, "none", 499, started)
            return Response(status_code=499)
        except Exception:  # a bug: answer in the OpenAI shape and keep the count honest
            log.exception("request handling failed")
            self._count(model, "none", 500, started)
            return error_response(APIError(500, "The gateway failed to handle this request.", code="internal_error"))

        decision = r.route.decision
        rt.router.learn(r.prep, r.route)
        self.metrics.decisions.labels(decision.path.value, decision.reason).inc()
        log.debug("request %s: %s (%s) decode=%s prefill=%s", r.request_id, decision.path.value,
                  decision.detail, decision.decode.url, decision.prefill.url if decision.prefill else "-")

        def done(outcome: Outcome) -> None:
            self._count(model, decision.path.value, outcome.status, started)

        headers = {PATH_HEADER: decision.path.value, "x-request-id": r.request_id,
                   TOKENS_HEADER: str(len(r.prompts[0]))}
        if r.prompts.approximate_reason:
            headers[TOKENS_HEADER + "-approximate"] = r.prompts.approximate_reason
        if rt.cfg.routing.debug_headers:
            headers[ROUTE_HEADER] = (f"{decision.reason}; {decision.detail}; decode={decision.decode.url}"
                                     + (f"; prefill={decision.prefill.url}" if decision.prefill else ""))
        return RelayResponse(
            start=lambda: rt.dispatcher.run(decision, r.req, path, r.request_id),
            stream=r.req.stream,
            headers=headers,
            on_done=done,
        )

    async def explain(self, request: Request) -> dict[str, Any]:
        """What the gateway would do with this body (``POST /debug/route``), without sending it."""
        rt = self.runtime
        kind = request.query_params.get("kind")
        if kind is None:  # a chat body has messages, a completion body a prompt
            kind = "chat" if b'"messages"' in await request.body() else "completion"
        if kind not in ("chat", "completion"):
            raise APIError(400, "kind must be 'chat' or 'completion'.", param="kind")
        r = await self._route(rt, request, kind, explain=True)  # type: ignore[arg-type]
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
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _count(self, model: str, path: str, status: int, started: float) -> None:
        self.metrics.requests.labels(model, path, str(status)).inc()
        self.metrics.duration.labels(path).observe(time.perf_counter() - started)
