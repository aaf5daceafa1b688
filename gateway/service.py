"""The request path, top to bottom: read, check, tokenize, decide, dispatch, relay."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from policies.base import Decider, Picker, RequestContext
from policies.pipeline import NoEndpointError, RoutingPipeline
from policies.registry import build

from .config import GatewayConfig, RoutingConfig
from .dispatch import Dispatcher
from .errors import APIError, error_response
from .metrics import GatewayMetrics
from .pools import Pools
from .protocol import Kind, parse_body, too_large
from .relay import Outcome, RelayResponse
from .tokenizer import Tokenizers

log = logging.getLogger(__name__)

PATH_HEADER = "x-pdgate-path"
TOKENS_HEADER = "x-pdgate-prompt-tokens"  # the gateway's own count, comparable with usage.prompt_tokens


def build_pipeline(cfg: RoutingConfig) -> RoutingPipeline:
    """The policies the YAML names; raises PolicyError (a ValueError) for unknown names or params."""
    return RoutingPipeline(
        decider=build(cfg.decider.name, cfg.decider.params, Decider),
        picker=build(cfg.picker.name, cfg.picker.params, Picker),
    )


_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(client_id: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (vLLM builds its response ids from it and
    suffixes its internal ids, so reuse cannot collide inside an engine), else a fresh one."""
    if client_id and _SAFE_ID.fullmatch(client_id):
        return client_id
    return uuid.uuid4().hex


class Gateway:
    """The OpenAI endpoints; every dependency is handed in, so tests can swap any of them."""

    def __init__(
        self,
        cfg: GatewayConfig,
        tokenizers: Tokenizers,
        pools: Pools,
        pipeline: RoutingPipeline,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
    ) -> None:
        self.cfg = cfg
        self.tokenizers = tokenizers
        self.pools = pools
        self.pipeline = pipeline
        self.dispatcher = dispatcher
        self.metrics = metrics

    async def chat(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: Request) -> Response | RelayResponse:
        return await self._handle(request, "completion", "/v1/completions")

    async def _handle(self, request: Request, kind: Kind, path: str) -> Response | RelayResponse:
        started = time.perf_counter()
        model = "unknown"
        try:
            req = parse_body(await self._read_body(request), kind)
            tok = self.tokenizers.get(req.model)
            if tok is None:
                raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found")
            model = req.model  # only configured names become metric labels
            prompts = await self.tokenizers.prompt_ids(tok, req)
            request_id = _request_id(request.headers.get("x-request-id"))
            ctx = RequestContext(
                model=req.model,
                request_id=request_id,
                token_ids=prompts[0],
                local_only=req.local_only(),
                headers=request.headers,
            )
            try:
                decision = self.pipeline.route(ctx, self.pools.snapshot())
            except NoEndpointError:
                raise APIError(503, "No decode engine is available right now.", code="no_healthy_endpoint",
                               type_="server_error") from None
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

        self.metrics.decisions.labels(decision.path.value, decision.reason).inc()
        log.debug("request %s: %s (%s) decode=%s prefill=%s", request_id, decision.path.value,
                  decision.detail, decision.decode.url, decision.prefill.url if decision.prefill else "-")

        def done(outcome: Outcome) -> None:
            self._count(req.model, decision.path.value, outcome.status, started)

        headers = {PATH_HEADER: decision.path.value, "x-request-id": request_id, TOKENS_HEADER: str(len(prompts[0]))}
        if prompts.approximate_reason:
            headers[TOKENS_HEADER + "-approximate"] = prompts.approximate_reason
        return RelayResponse(
            start=lambda: self.dispatcher.run(decision, req, path, request_id),
            stream=req.stream,
            headers=headers,
            on_done=done,
        )

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.server.max_body_bytes
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
