"""The HTTP face of one simulated engine: ``create_app(cfg) -> Starlette``.

vLLM-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/completions/render``, ``POST /v1/chat/completions/render`` (the prompt's token ids
and sampling params, nothing run: what vllm-router calls before its P/D legs),
``GET /v1/models``, ``GET /health``, ``GET /version``, ``GET /metrics``, and with
``VLLM_SERVER_DEV_MODE=1`` vLLM's dev route ``POST /reset_prefix_cache``
(``?reset_running_requests=true`` preempts running requests first) -> ``{"success": bool}``.

Sim-only test instrumentation (not in vLLM):

* ``GET /sim/requests``: ``{"engine_id", "role", "requests": [...]}`` with the last 1000
  generation requests, oldest first. Each record: ``request_id`` (the X-Request-Id header,
  or null), ``headers`` (all request headers, lower-case names), ``response_id``,
  ``internal_ids`` (engine request ids; a prefill leg's is its ``remote_request_id``),
  ``endpoint``, ``body`` (the JSON body exactly as received, parsed), ``kind``
  (plain|prefill|decode, null if the body was unusable), ``stream``, ``status``
  (running|completed|aborted|failed), ``http_status``, ``finish_reasons``,
  ``error``, ``kv_transfer_params`` (what the response carried), and wall-clock
  timestamps ``received_at``, ``first_token_at``, ``finished_at``.
* ``DELETE /sim/requests``: forget them.
* ``GET /sim/state``: scheduler and KV snapshot (running, waiting, free blocks, held
  prefill handles, cached blocks, the KV event endpoints as bound and messages published,
  the faults and how often each was injected).
* ``GET /sim/faults``, ``PUT /sim/faults`` (JSON spec, replaces the faults), ``DELETE
  /sim/faults`` (no faults, counters reset): fault injection (:mod:`engine_model.faults`), answering
  ``{"faults": {...}, "injected": {...}}``; a bad spec gets 400 ``{"detail": ...}``.
* ``POST /sim/crash``: answers, then exits the process at once (no shutdown, connections cut).

The two generation routes are raw ASGI callables: each request watches for
``http.disconnect`` while it waits, and a disconnect aborts its engine requests at once
(releasing their KV blocks; a queued decode leg also tells its prefill engine to drop
the blocks it holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_model.config import SimConfig
from engine_model.engine import DECODE, Collector, Engine, Seq
from engine_model.faults import ConnectionDropped, Faults, FaultSpecError, FaultySend, Plan
from engine_model.kv import KVServer
from engine_model.kv_events import EventSink, ZmqEventPublisher
from engine_model.metrics import SimMetrics
from engine_model.tokens import load_tokenizer
from sim import protocol as P

log = logging.getLogger("sim.app")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON_CT = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
INTERNAL_ERROR = P.ApiError("Internal server error", 500, "InternalServerError")  # vLLM's GenerationError
RETRYABLE_ERROR = P.ApiError("Request failed; please retry", 503, "ServiceUnavailableError")  # RetryableRequestError


async def _send_json(send: Send, status: int, obj: Any) -> None:
    data = orjson.dumps(obj)
    headers = [(b"content-length", str(len(data)).encode()), _JSON_CT]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _json(obj: Any, status: int = 200, background: BackgroundTask | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", background=background)


class Records:
    """The last requests the engine saw (sim-only instrumentation)."""

    def __init__(self, maxlen: int = 1000) -> None:
        self.items: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.counter = 0

    def new(self, scope: Scope, header_id: str | None, endpoint: str) -> dict[str, Any]:
        self.counter += 1
        rec: dict[str, Any] = {
            "n": self.counter,
            "request_id": header_id,
            "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            "response_id": None,
            "internal_ids": [],
            "endpoint": endpoint,
            "body": None,
            "kind": None,
            "stream": False,
            "status": "running",
            "http_status": None,
            "finish_reasons": [],
            "error": None,
            "fault": None,
            "kv_transfer_params": None,
            "received_at": time.time(),
            "first_token_at": None,
            "finished_at": None,
        }
        self.items.append(rec)
        return rec


class SimState:
    """Everything one app instance owns (no module-level state)."""

    def __init__(self, cfg: SimConfig, event_sink: EventSink | None = None) -> None:
        """``event_sink``: receives KV events instead of a ZMQ publisher (in-process tests)."""
        self.cfg = cfg
        self.event_sink = event_sink
        self.metrics = SimMetrics(cfg)
        self.tok = load_tokenizer(cfg.tokenizer)
        self.engine: Engine | None = None
        self.kv_server: KVServer | None = None
        self.publisher: ZmqEventPublisher | None = (
            ZmqEventPublisher(cfg.kv_events_config, bind_host=cfg.host) if cfg.kv_events_config.active else None
        )
        self.records = Records()
        self.faults = Faults(cfg.faults)
        self.exit: Callable[[int], None] = os._exit  # POST /sim/crash (tests in-process replace it)
        digest = hashlib.sha256(
            f"{cfg.model}|{cfg.max_model_len}|{cfg.block_size}|{cfg.tokenizer}".encode()
        ).hexdigest()
        self.fingerprint = f"vllm-{P.VLLM_VERSION}-{digest[:8]}"
        self.created = int(time.time())

    async def start(self) -> None:
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.start)
        sink = self.event_sink if self.event_sink is not None else self.publisher
        engine = Engine(self.cfg, self.metrics, self.tok.output_vocab, publisher=sink, faults=self.faults)
        self.kv_server = KVServer(
            {"read": engine.kv_read, "notify": engine.kv_notify, "hb": engine.kv_heartbeat},
            self.cfg.host,
            self.cfg.kv_port,
        )
        engine.kv_port = await self.kv_server.start()
        await engine.start()
        self.engine = engine
        log.info(
            "sim engine %s (role %s, model %s) side channel on %s:%s",
            self.cfg.engine_id,
            self.cfg.role,
            self.cfg.model,
            self.cfg.advertised_kv_host,
            engine.kv_port,
        )

    async def stop(self) -> None:
        if self.kv_server is not None:
            await self.kv_server.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.shutdown)


def _header(scope: Scope, name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]  # ASGI: (name, value) byte pairs
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


class GenerateEndpoint:
    """POST /v1/completions and /v1/chat/completions as a raw ASGI app."""

    def __init__(self, state: SimState, endpoint: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        self.parse = P.parse_completion if endpoint == "completions" else P.parse_chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        header_id = _header(scope, b"x-request-id")
        rec = state.records.new(scope, header_id, self.path)
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                rec["status"] = "aborted"
                rec["finished_at"] = time.time()
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        job: P.Job | None = None
        kv_for_release: dict[str, Any] | None = None
        try:
            ctype = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise P.ApiError(
                    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    400,
                    "Bad Request",
                )
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = P.parse_json_like_fastapi(raw)
            rec["body"] = body
            if isinstance(body, dict):
                kv = body.get("kv_transfer_params")
                rec["kind"] = P.classify_kv(kv)
                rec["stream"] = bool(body.get("stream"))
                if rec["kind"] == DECODE and isinstance(kv, dict):
                    kv_for_release = kv
            job = self.parse(body, state.cfg, state.tok, header_id)
            rec["response_id"] = job.response_id
        except P.ApiError as e:
            if kv_for_release is not None and e.err_type != "Bad Request":
                # Request-schema errors happen before vLLM's serving layer; later ones free
                # the prefill engine's blocks.
                self._release_rejected(kv_for_release)
            await self._send_error(send, e, rec)
            return
        plan = state.faults.plan(job.kind)
        rec["fault"] = "+".join(plan.applied) or None
        if plan.error_status is not None:
            if job.kind == DECODE and job.kv_in:
                self._release_rejected(job.kv_in)
            await self._send_error(send, INTERNAL_ERROR if plan.error_status == 500 else RETRYABLE_ERROR, rec)
            return
        if plan.hang:
            await self._hang(job, receive, rec)
            return
        await self._run(job, scope, receive, send, rec, plan)

    async def _hang(self, job: P.Job, receive: Receive, rec: dict[str, Any]) -> None:
        """The ``hang`` fault: never answer; forget the request once its client is gone."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            rec["status"] = "aborted"
            rec["finished_at"] = time.time()
        if job.kind == DECODE and job.kv_in:
            self._release_rejected(job.kv_in)  # as for a queued decode leg that is aborted

    def _release_rejected(self, kv: dict[str, Any]) -> None:
        """vLLM frees a prefill engine's blocks when a decode leg is rejected before the engine
        sees it (``notify_kv_transfer_request_rejected``)."""
        if not all(kv.get(f) not in (None, "", []) for f in P.REQUIRED_REMOTE_FIELDS):
            return
        engine = self.state.engine
        if engine is None or not self.state.cfg.accepts_decode_legs():
            return
        engine.release_remote(kv)

    async def _send_error(self, send: Send, err: P.ApiError, rec: dict[str, Any]) -> None:
        rec["status"] = "failed"
        rec["http_status"] = err.status
        rec["error"] = err.message
        rec["finished_at"] = time.time()
        await _send_json(send, err.status, err.body())

    async def _run(  # noqa: C901 - over the limit before it was set; to split
        self, job: P.Job, scope: Scope, receive: Receive, send: Send, rec: dict[str, Any], plan: Plan
    ) -> None:
        state = self.state
        engine = state.engine
        assert engine is not None
        closed = asyncio.Event()  # the client is gone (ends fault delays at once)
        if plan.shapes_response:
            send = FaultySend(send, plan, job.stream, closed)
        job.created = int(time.time())
        ids = P.internal_ids(job)
        rec["internal_ids"] = ids
        late: P.ApiError | None = None
        for ids_prompt in job.prompts:
            try:
                P.check_engine_prompt(ids_prompt)
            except P.ApiError as e:
                late = e
                break
        if late is not None:
            if job.kind == DECODE and job.kv_in:
                self._release_rejected(job.kv_in)
            if not job.stream:
                await self._send_error(send, late, rec)
                return
            rec["status"] = "failed"
            rec["http_status"] = 200
            rec["error"] = late.message
            rec["finished_at"] = time.time()
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "body": late.sse() + P.SSE_DONE})
            return

        collector = Collector(len(job.prompts) * job.n)
        for p_idx, prompt in enumerate(job.prompts):
            for c in range(job.n):
                seq = Seq(
                    ids[p_idx] if job.n == 1 else f"{c}_{ids[p_idx]}",
                    prompt,
                    job.max_tokens[p_idx],
                    kind=job.kind,
                    min_tokens=job.min_tokens,
                    choice=c,
                    stop=job.stop,
                    stop_token_ids=job.stop_token_ids,
                    ignore_eos=job.ignore_eos,
                    kv_in=job.kv_in,
                    n_param=job.n,
                    collector=collector,
                )
                job.seqs.append(seq)
        for seq in job.seqs:
            engine.submit(seq)

        disconnected = False

        def on_disconnect() -> None:
            # Servers also report http.disconnect once a response is complete: ignore that.
            nonlocal disconnected
            closed.set()
            if rec["status"] != "running":
                return
            disconnected = True
            for s in job.seqs:
                engine.abort(s)
            rec["status"] = "aborted"
            rec["finish_reasons"] = [s.finish_reason for s in job.seqs]
            rec["finished_at"] = time.time()
            collector.event.set()

        watcher = asyncio.create_task(_watch_disconnect(receive, on_disconnect))
        try:
            if job.stream:
                await self._stream(job, collector, send, rec, lambda: disconnected)
            else:
                await collector.done
                if not disconnected:
                    await self._full(job, send, rec)
        except ConnectionDropped:
            rec["status"] = "dropped"
            rec["finished_at"] = time.time()
            raise  # the server closes the connection of a response it cannot complete
        finally:
            watcher.cancel()
            if not all(s.finished for s in job.seqs):  # cancelled from outside: do not leak
                for s in job.seqs:
                    engine.abort(s)
                if rec["status"] == "running":
                    rec["status"] = "aborted"
                    rec["finished_at"] = time.time()

    def _finish_record(self, job: P.Job, rec: dict[str, Any], status: str, http_status: int) -> None:
        rec["status"] = status
        rec["http_status"] = http_status
        rec["finish_reasons"] = [s.finish_reason for s in job.seqs]
        rec["kv_transfer_params"] = job.seqs[0].kv_out if job.seqs else None
        firsts = [s.first_token_t for s in job.seqs if s.first_token_t is not None]
        if firsts:
            rec["first_token_at"] = time.time() - (time.monotonic() - min(firsts))
        rec["finished_at"] = time.time()

    async def _full(self, job: P.Job, send: Send, rec: dict[str, Any]) -> None:
        state = self.state
        if any(s.finish_reason == "error" for s in job.seqs):
            self._finish_record(job, rec, "failed", 500)
            rec["error"] = "; ".join(s.error or "" for s in job.seqs if s.error)
            await _send_json(send, 500, INTERNAL_ERROR.body())
            return
        details = state.cfg.enable_prompt_tokens_details
        if job.endpoint == "completions":
            body = P.completion_response(job, state.cfg.model, state.fingerprint, details)
        else:
            body = P.chat_response(job, state.cfg.model, state.fingerprint, details)
        self._finish_record(job, rec, "completed", 200)
        await _send_json(send, 200, body)

    async def _stream(  # noqa: C901 - over the limit before it was set; to split
        self,
        job: P.Job,
        collector: Collector,
        send: Send,
        rec: dict[str, Any],
        gone: Callable[[], bool],
    ) -> None:
        """vLLM's stream generators: one SSE event per output delta (deltas that piled up
        while the client was slow are merged, as vLLM's output collector does)."""
        state = self.state
        model = state.cfg.model
        fp = state.fingerprint
        chat = job.endpoint == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        rid = job.response_id
        created = job.created
        n = job.n
        first_iteration = True
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        while True:
            await collector.event.wait()
            collector.event.clear()
            if gone():
                return
            out: list[bytes] = []
            failed = any(s.finish_reason == "error" for s in job.seqs)
            if chat and first_iteration and (failed or any(s.output_ids for s in job.seqs)):
                # The role chunk goes out with the engine's first output (even a failed one).
                first_iteration = False
                for c in range(n):
                    chunk: dict[str, Any] = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [
                            {
                                "index": c,
                                "delta": {"role": job.role, "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if job.continuous_usage:
                        p_len = len(job.prompts[0])
                        chunk["usage"] = {
                            "prompt_tokens": p_len,
                            "total_tokens": p_len,
                            "completion_tokens": 0,
                            "completion_tokens_details": None,
                        }
                    chunk["prompt_token_ids"] = job.prompts[0] if job.return_token_ids else None
                    chunk["prompt_text"] = None
                    out.append(P.sse(chunk))
            if failed:
                out.append(INTERNAL_ERROR.sse())
                out.append(P.SSE_DONE)
                self._finish_record(job, rec, "failed", 200)
                rec["error"] = "; ".join(s.error or "" for s in job.seqs if s.error)
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
                engine = self.state.engine
                assert engine is not None  # _run() checked it, and it is never unset once started
                for s in job.seqs:
                    engine.abort(s)
                return
            for idx, seq in enumerate(job.seqs):
                if seq.final_sent:
                    continue
                n_tok = len(seq.output_ids)
                finished = seq.finished
                if n_tok == seq.tokens_sent and not finished:
                    continue
                text = seq.text() if finished else "".join(seq.pieces)
                delta = text[seq.text_len_sent :]
                new_ids = seq.output_ids[seq.tokens_sent :]
                first_chunk = seq.tokens_sent == 0
                seq.tokens_sent = n_tok
                seq.text_len_sent = max(len(text), seq.text_len_sent)
                seq.final_sent = finished
                if chat:
                    choice: dict[str, Any] = {"index": idx, "delta": {"content": delta}, "logprobs": None}
                    if finished:
                        choice["finish_reason"] = seq.finish_reason
                        choice["stop_reason"] = seq.stop_reason
                    else:
                        choice["finish_reason"] = None
                    choice["token_ids"] = new_ids if job.return_token_ids else None
                    p_len = len(job.prompts[0])
                else:
                    p_idx = idx // n
                    p_len = len(job.prompts[p_idx])
                    choice = {
                        "index": idx,
                        "text": delta,
                        "logprobs": None,
                        "finish_reason": seq.finish_reason if finished else None,
                        "stop_reason": seq.stop_reason if finished else None,
                        "prompt_token_ids": job.prompts[p_idx] if (job.return_token_ids and first_chunk) else None,
                        "token_ids": new_ids if job.return_token_ids else None,
                    }
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if job.continuous_usage:
                    usage: dict[str, Any] = {
                        "prompt_tokens": p_len,
                        "total_tokens": p_len + n_tok,
                        "completion_tokens": n_tok,
                    }
                    if chat:
                        usage["completion_tokens_details"] = None
                    chunk["usage"] = usage
                if finished and not job.include_usage and fp is not None:
                    chunk["system_fingerprint"] = fp
                out.append(P.sse(chunk))
            if collector.pending <= 0:
                if job.include_usage:
                    n_prompt = len(job.prompts[0]) if chat else sum(len(p) for p in job.prompts)
                    n_gen = sum(len(s.output_ids) for s in job.seqs)
                    final_usage = P.usage_short(n_prompt, n_gen)
                    if state.cfg.enable_prompt_tokens_details:
                        final_usage["prompt_tokens_details"] = P.prompt_tokens_details(job, stream=True)
                    out.append(
                        P.sse(
                            {
                                "id": rid,
                                "object": obj,
                                "created": created,
                                "model": model,
                                "choices": [],
                                "usage": final_usage,
                                "system_fingerprint": fp,
                            }
                        )
                    )
                out.append(P.SSE_DONE)
                self._finish_record(job, rec, "completed", 200)
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
                return
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            on_disconnect()
            return


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: echo X-Request-Id (or a fresh uuid4 hex)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _header(scope, b"x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*list(message.get("headers", [])), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(cfg: SimConfig) -> Starlette:  # noqa: C901 - over the limit before it was set; to split
    """Build the ASGI app for one engine. Nothing starts until the app's lifespan runs."""
    state = SimState(cfg)

    async def models(request: Request) -> Response:
        root = cfg.tokenizer or cfg.model
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": root,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{P.random_id()}",
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
                        ],
                    }
                ],
            }
        )

    async def render(request: Request) -> Response:
        # vLLM's /v1/completions/render (a list of GenerateRequest) and /v1/chat/completions/render
        # (one GenerateRequest): the prompt tokenized and the sampling params resolved, nothing run.
        chat = request.url.path.startswith("/v1/chat/")
        try:
            ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise P.ApiError(
                    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    400,
                    "Bad Request",
                )
            raw = await request.body()
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = P.parse_json_like_fastapi(raw)
            if isinstance(body, dict):
                body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            if chat and isinstance(body, dict) and body.get("use_beam_search"):
                raise P.validation_error("Beam search is not supported by the render endpoint")
            job = (P.parse_chat if chat else P.parse_completion)(body, cfg, state.tok, None)
        except P.ApiError as e:
            return _json(e.body(), e.status)
        out = P.render_requests(body, job)
        return _json(out[0] if chat else out)

    async def health(request: Request) -> Response:
        return Response(status_code=200 if state.engine is not None else 503)

    async def version(request: Request) -> Response:
        return _json({"version": P.VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        if state.engine is not None:
            state.engine.update_gauges()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def sim_requests(request: Request) -> Response:
        if request.method == "DELETE":
            state.records.items.clear()
            return _json({"cleared": True})
        return _json({"engine_id": cfg.engine_id, "role": cfg.role, "requests": list(state.records.items)})

    async def sim_state(request: Request) -> Response:
        e = state.engine
        if e is None:
            return _json({"ready": False}, 503)
        return _json(
            {
                "ready": True,
                "engine_id": cfg.engine_id,
                "role": cfg.role,
                "kv_host": cfg.advertised_kv_host,
                "kv_port": e.kv_port,
                "running": len(e.running),
                "waiting": len(e.waiting) + len(e.ready_kv),
                "kv_loading": len(e.remote_kv),
                "free_blocks": e.pool.num_free,
                "total_blocks": e.total_blocks,
                "kv_cache_usage": e.kv_usage(),
                "held": {rid: len(h.block_ids) for rid, h in e.held.items()},
                "prefix_caching": cfg.enable_prefix_caching,
                "cached_blocks": e.pool.num_cached,
                "profile": cfg.profile,
                "time_scale": cfg.time_scale,
                "faults": state.faults.snapshot(),
                "kv_events": None
                if state.publisher is None
                else {
                    "endpoint": state.publisher.endpoint,
                    "replay_endpoint": state.publisher.replay_endpoint,
                    "topic": cfg.kv_events_config.topic,
                    "published": state.publisher.published,
                    "dropped": state.publisher.dropped,
                },
            }
        )

    async def sim_faults(request: Request) -> Response:
        if request.method == "PUT":
            try:
                state.faults.configure(orjson.loads(await request.body()))
            except orjson.JSONDecodeError as e:
                return _json({"detail": f"body is not valid JSON: {e}"}, 400)
            except FaultSpecError as e:
                return _json({"detail": str(e)}, 400)
        elif request.method == "DELETE":
            state.faults.clear()
        return _json(state.faults.snapshot())

    async def sim_crash(request: Request) -> Response:
        log.warning("POST /sim/crash: exiting now")
        return _json({"crashing": True, "pid": os.getpid()}, background=BackgroundTask(state.exit, 1))

    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM's dev route: POST /reset_prefix_cache?reset_running_requests=&reset_external=
        e = state.engine
        if e is None:
            return _json({"detail": "engine not started"}, 503)
        running = request.query_params.get("reset_running_requests", "false").lower() in ("1", "true", "yes", "on")
        return _json({"success": e.reset_prefix_cache(reset_running_requests=running)})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", "Internal Server Error")
        return _json({"detail": detail}, status)

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
        Route("/sim/requests", sim_requests, methods=["GET", "DELETE"]),
        Route("/sim/state", sim_state, methods=["GET"]),
        Route("/sim/faults", sim_faults, methods=["GET", "PUT", "DELETE"]),
        Route("/sim/crash", sim_crash, methods=["POST"]),
    ]
    if cfg.server_dev_mode:
        routes.append(Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.sim = state
    if cfg.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    return app


__all__ = ["SimState", "create_app"]
