"""LoRA adapters on the HTTP side, as vLLM 0.32's API server has them: the adapters a request's
``model`` may name (:class:`LoRARegistry`, vLLM's ``OpenAIServingModels``), their ``/v1/models``
cards, and the runtime routes.

* ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": false,
  "is_3d_lora_weight": false}`` and ``POST /v1/unload_lora_adapter {"lora_name", "lora_int_id"}``
  exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or ``true``
  (``vllm/entrypoints/serve/lora/api_router.py:30-32``). Success: HTTP 200, a plain-text body
  without content type, ``Success: LoRA adapter 'X' added successfully.`` / ``... removed
  successfully.``. Errors (``vllm/entrypoints/openai/models/serving.py:166-296``): no name or path
  400 InvalidUserInput; the base model's name 400; a name already loaded (without
  ``load_inplace``) 400; a path that is not a folder 404 NotFoundError ``Loading lora X failed: No
  adapter found for <path>`` (paths masked as vLLM's ``sanitize_message`` does); a rank above
  ``--max-lora-rank`` 500 InternalServerError; unloading an unknown name 404.
* Ids: a counter per API server, 1, 2, ... in load order (a failed load uses one up too); a
  reload in place keeps its id. Unloading only forgets the name: the engine keeps the adapter
  loaded and its blocks cached (vLLM never calls ``remove_lora`` there).
* ``--lora-modules`` are loaded the same way when the engine starts; a failure stops the start.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_model.adapters import AdapterLoadError, LoRARequest, check_adapter, sanitize_message
from engine_model.config import SimConfig
from sim.asgi import json_response
from sim.errors import ApiError, parse_json_like_fastapi, schema_error

if TYPE_CHECKING:
    from engine_model.engine import Engine
    from sim.state import SimState


class LoRARegistry:
    """The adapters this API server serves, by name (``lora_requests``), and their id counter."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.requests: dict[str, LoRARequest] = {}
        self._last_id = 0
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def load(
        self,
        engine: Engine,
        name: str,
        path: str,
        *,
        load_inplace: bool = False,
        base_model_name: str | None = None,
    ) -> str:
        """vLLM's ``load_lora_adapter``: the success text, or :class:`ApiError` as vLLM answers."""
        async with self._locks[name]:
            if not name or not path:
                raise ApiError("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
            if name == self.cfg.model:
                raise ApiError(
                    f"The lora adapter '{name}' conflicts with a served base model.", 400, "InvalidUserInput"
                )
            old = self.requests.get(name)
            if old is not None and not load_inplace:
                raise ApiError(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True.",
                    400,
                    "InvalidUserInput",
                )
            if old is not None:
                int_id = old.int_id
            else:
                self._last_id += 1
                int_id = self._last_id
            base = base_model_name if base_model_name == self.cfg.model else None
            lora = LoRARequest(name, int_id, path, base, load_inplace)
            try:
                if self.cfg.enable_lora:
                    check_adapter(name, path, self.cfg.max_lora_rank)
                await engine.add_lora(lora)
            except AdapterLoadError as e:
                raise ApiError(sanitize_message(e.message), e.status, e.err_type) from None
            self.requests[name] = lora
            return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        """vLLM's ``unload_lora_adapter``: forgets the name (the engine keeps the adapter)."""
        async with self._locks[name]:
            if not name:
                raise ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput")
            if name not in self.requests:
                raise ApiError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
            del self.requests[name]
            return f"Success: LoRA adapter '{name}' removed successfully."

    async def load_static(self, engine: Engine) -> None:
        """``--lora-modules`` at start-up (``init_static_loras``): any failure stops the start."""
        for mod in self.cfg.lora_modules:
            try:
                await self.load(engine, mod.name, mod.path, base_model_name=mod.base_model_name)
            except ApiError as e:
                raise ValueError(f"--lora-modules {mod.name}={mod.path}: {e.message}") from None

    def cards(self, permission: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
        """The adapters' ``/v1/models`` cards, after the base model's (``show_available_models``)."""
        now = int(time.time())
        return [
            {
                "id": lora.name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": lora.path,
                "parent": lora.base_model_name or self.cfg.model,
                "max_model_len": None,
                "permission": [permission()],
            }
            for lora in self.requests.values()
        ]


def _sim(request: Request) -> SimState:
    state: SimState = request.app.state.sim
    return state


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object of a LoRA route, checked as vLLM's ``validate_json_request`` and pydantic do."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", 400, "Bad Request"
        )
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = parse_json_like_fastapi(raw)
    if not isinstance(body, dict):
        raise schema_error("Input should be a valid dictionary or object to extract fields from")
    return body


def _str_field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if v is None:
        raise schema_error("Field required", f"body.{name}")
    if not isinstance(v, str):
        raise schema_error("Input should be a valid string", f"body.{name}")
    return v


def _bool_field(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if isinstance(v, bool):
        return v
    if v in (0, 1, "0", "1", "true", "false", "True", "False"):  # pydantic's lax booleans (the usual ones)
        return str(v).lower() in ("1", "true")
    raise schema_error("Input should be a valid boolean", f"body.{name}")


async def load_lora_adapter(request: Request) -> Response:
    state = _sim(request)
    engine = state.engine
    if engine is None:
        return json_response({"detail": "engine not started"}, 503)
    try:
        body = await _body(request)
        name, path = _str_field(body, "lora_name"), _str_field(body, "lora_path")
        inplace = _bool_field(body, "load_inplace")
        _bool_field(body, "is_3d_lora_weight")
        text = await state.loras.load(engine, name, path, load_inplace=inplace)
    except ApiError as e:
        return json_response(e.body(), e.status)
    return Response(text, status_code=200)  # plain text, no content type: vLLM's Response(content=str)


async def unload_lora_adapter(request: Request) -> Response:
    state = _sim(request)
    try:
        body = await _body(request)
        name = _str_field(body, "lora_name")
        lora_int_id = body.get("lora_int_id")  # accepted, unused (as in vLLM)
        if lora_int_id is not None and type(lora_int_id) is not int:
            raise schema_error("Input should be a valid integer", "body.lora_int_id")
        text = await state.loras.unload(name)
    except ApiError as e:
        return json_response(e.body(), e.status)
    return Response(text, status_code=200)


ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
