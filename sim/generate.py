"""The two generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``, as raw
ASGI callables (:class:`GenerateEndpoint`): read the body, check it (:mod:`sim.parsing`), apply the
request's fault plan, submit one engine request per prompt and choice, and answer in one body
(:mod:`sim.responses`) or as a stream (:mod:`sim.streaming`).

They are raw ASGI rather than Starlette endpoints so that each request watches for
``http.disconnect`` while it waits: a disconnect aborts its engine requests at once (releasing
their KV blocks; a queued decode leg also tells its prefill engine to drop the blocks it holds).
A decode leg rejected before the engine sees it frees the prefill engine's blocks too, as vLLM's
``notify_kv_transfer_request_rejected`` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson

from engine_model.engine import Engine
from engine_model.faults import ConnectionDropped, FaultySend, Plan
from engine_model.seq import DECODE, Collector, Seq
from sim.asgi import SSE_HEADERS, Receive, Scope, Send, header, send_json
from sim.errors import INTERNAL_ERROR, RETRYABLE_ERROR, ApiError, parse_json_like_fastapi
from sim.parsing import (
    REQUIRED_REMOTE_FIELDS,
    Job,
    check_engine_prompt,
    classify_kv,
    internal_ids,
    parse_chat,
    parse_completion,
)
from sim.responses import SSE_DONE, chat_response, completion_response
from sim.state import SimState, finish_record
from sim.streaming import stream


class GenerateEndpoint:
    """POST /v1/completions and /v1/chat/completions as a raw ASGI app."""

    def __init__(self, state: SimState, endpoint: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        self.parse = parse_completion if endpoint == "completions" else parse_chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        header_id = header(scope, b"x-request-id")
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
        job: Job | None = None
        kv_for_release: dict[str, Any] | None = None
        try:
            ctype = (header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(
                    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    400,
                    "Bad Request",
                )
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = parse_json_like_fastapi(raw)
            rec["body"] = body
            if isinstance(body, dict):
                kv = body.get("kv_transfer_params")
                rec["kind"] = classify_kv(kv)
                rec["stream"] = bool(body.get("stream"))
                if rec["kind"] == DECODE and isinstance(kv, dict):
                    kv_for_release = kv
            job = self.parse(body, state.cfg, state.tok, header_id, state.loras.requests)
            rec["response_id"] = job.response_id
        except ApiError as e:
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

    async def _hang(self, job: Job, receive: Receive, rec: dict[str, Any]) -> None:
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
        if not all(kv.get(f) not in (None, "", []) for f in REQUIRED_REMOTE_FIELDS):
            return
        engine = self.state.engine
        if engine is None or not self.state.cfg.accepts_decode_legs():
            return
        engine.release_remote(kv)

    async def _send_error(self, send: Send, err: ApiError, rec: dict[str, Any]) -> None:
        rec["status"] = "failed"
        rec["http_status"] = err.status
        rec["error"] = err.message
        rec["finished_at"] = time.time()
        await send_json(send, err.status, err.body())

    async def _run(self, job: Job, scope: Scope, receive: Receive, send: Send, rec: dict[str, Any], plan: Plan) -> None:
        state = self.state
        engine = state.engine
        assert engine is not None
        closed = asyncio.Event()  # the client is gone (ends fault delays at once)
        if plan.shapes_response:
            send = FaultySend(send, plan, job.stream, closed)
        job.created = int(time.time())
        ids = internal_ids(job)
        rec["internal_ids"] = ids
        if await self._failed_late(job, send, rec):
            return
        collector = _submit(engine, job, ids)
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
                await stream(state, job, collector, send, rec, lambda: disconnected)
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

    async def _failed_late(self, job: Job, send: Send, rec: dict[str, Any]) -> bool:
        """vLLM's input-processor checks, once the engine has the request: an error body, or in
        streaming mode HTTP 200 and an error event. True when the request failed them."""
        late: ApiError | None = None
        for ids_prompt in job.prompts:
            try:
                check_engine_prompt(ids_prompt)
            except ApiError as e:
                late = e
                break
        if late is None:
            return False
        if job.kind == DECODE and job.kv_in:
            self._release_rejected(job.kv_in)
        if not job.stream:
            await self._send_error(send, late, rec)
            return True
        rec["status"] = "failed"
        rec["http_status"] = 200
        rec["error"] = late.message
        rec["finished_at"] = time.time()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await send({"type": "http.response.body", "body": late.sse() + SSE_DONE})
        return True

    async def _full(self, job: Job, send: Send, rec: dict[str, Any]) -> None:
        state = self.state
        if any(s.finish_reason == "error" for s in job.seqs):
            finish_record(job, rec, "failed", 500)
            rec["error"] = "; ".join(s.error or "" for s in job.seqs if s.error)
            await send_json(send, 500, INTERNAL_ERROR.body())
            return
        details = state.cfg.enable_prompt_tokens_details
        if job.endpoint == "completions":
            body = completion_response(job, job.model or state.cfg.model, state.fingerprint, details)
        else:
            body = chat_response(job, job.model or state.cfg.model, state.fingerprint, details)
        finish_record(job, rec, "completed", 200)
        await send_json(send, 200, body)


def _submit(engine: Engine, job: Job, ids: list[str]) -> Collector:
    """One engine request per prompt and choice, all reporting to one collector."""
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
                lora=job.lora,
            )
            job.seqs.append(seq)
    for seq in job.seqs:
        engine.submit(seq)
    return collector


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            on_disconnect()
            return
