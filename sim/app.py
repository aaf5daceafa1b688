"""The HTTP face of one simulated engine: ``create_app(cfg) -> Starlette``, and its vLLM routes.

vLLM-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``
(:mod:`sim.generate`, streaming in :mod:`sim.streaming`), ``POST /v1/completions/render``,
``POST /v1/chat/completions/render`` (the prompt's token ids and sampling params, nothing run:
what vllm-router calls before its P/D legs), ``GET /v1/models``, ``GET /health``, ``GET /version``,
``GET /metrics``, and with ``VLLM_SERVER_DEV_MODE=1`` vLLM's dev route
``POST /reset_prefix_cache`` (``?reset_running_requests=true`` preempts running requests first)
-> ``{"success": bool}``; with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` (:mod:`sim.lora_routes`, which also lists the adapters in
``/v1/models``); with ``--enable-request-id-headers``, X-Request-Id on every answer.

The simulator's own ``/sim/*`` routes (records, state, faults, crash) are :mod:`sim.controls`;
what the app owns (engine, side channel, publisher, records) is :class:`sim.state.SimState`,
found by the handlers on ``request.app.state.sim``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_model.config import SimConfig
from sim import controls, lora_routes
from sim.asgi import Receive, Scope, Send, header, json_response
from sim.errors import ApiError, parse_json_like_fastapi, validation_error
from sim.generate import GenerateEndpoint
from sim.parsing import parse_chat, parse_completion, random_id
from sim.responses import VLLM_VERSION, render_requests
from sim.state import SimState


def _sim(request: Request) -> SimState:
    state: SimState = request.app.state.sim
    return state


def _permission() -> dict[str, Any]:
    return {
        "id": f"modelperm-{random_id()}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def models(request: Request) -> Response:
    """The base model's card, then one per LoRA adapter (:mod:`sim.lora_routes`)."""
    state = _sim(request)
    cfg = state.cfg
    base = {
        "id": cfg.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": cfg.tokenizer or cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [_permission()],
    }
    return json_response({"object": "list", "data": [base, *state.loras.cards(_permission)]})


async def render(request: Request) -> Response:
    """vLLM's /v1/completions/render (a list of GenerateRequest) and /v1/chat/completions/render
    (one GenerateRequest): the prompt tokenized and the sampling params resolved, nothing run."""
    state = _sim(request)
    chat = request.url.path.startswith("/v1/chat/")
    try:
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                400,
                "Bad Request",
            )
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = parse_json_like_fastapi(raw)
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if chat and isinstance(body, dict) and body.get("use_beam_search"):
            raise validation_error("Beam search is not supported by the render endpoint")
        job = (parse_chat if chat else parse_completion)(body, state.cfg, state.tok, None, state.loras.requests)
    except ApiError as e:
        return json_response(e.body(), e.status)
    out = render_requests(body, job)
    return json_response(out[0] if chat else out)


async def health(request: Request) -> Response:
    return Response(status_code=200 if _sim(request).engine is not None else 503)


async def version(request: Request) -> Response:
    return json_response({"version": VLLM_VERSION})


async def metrics(request: Request) -> Response:
    state = _sim(request)
    if state.engine is not None:
        state.engine.update_gauges()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    # vLLM's dev route: POST /reset_prefix_cache?reset_running_requests=&reset_external=
    e = _sim(request).engine
    if e is None:
        return json_response({"detail": "engine not started"}, 503)
    q = request.query_params

    def flag(name: str) -> bool:
        return q.get(name, "false").lower() in ("1", "true", "yes", "on")

    ok = e.reset_prefix_cache(
        reset_running_requests=flag("reset_running_requests"), reset_connector=flag("reset_external")
    )
    return json_response({"success": ok})


async def http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "Internal Server Error")
    return json_response({"detail": detail}, status)


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: echo X-Request-Id (or a fresh uuid4 hex)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = header(scope, b"x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*list(message.get("headers", [])), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(cfg: SimConfig) -> Starlette:
    """Build the ASGI app for one engine. Nothing starts until the app's lifespan runs."""
    state = SimState(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    routes = [
        Route("/v1/completions", GenerateEndpoint(state, "completions"), methods=["POST"]),
        Route("/v1/chat/completions", GenerateEndpoint(state, "chat"), methods=["POST"]),
        Route("/v1/completions/render", render, methods=["POST"]),
        Route("/v1/chat/completions/render", render, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *controls.ROUTES,
    ]
    if cfg.server_dev_mode:
        routes.append(Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]))
    if cfg.allow_runtime_lora_updating:
        routes.extend(lora_routes.ROUTES)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.sim = state
    if cfg.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    return app


__all__ = ["SimState", "create_app"]
