"""The P/D handshake with vLLM's NixlConnector (DESIGN.md, "The P/D handshake"), with failover.

1. prefill leg: the client's body, non-streaming, one output token, asking for remote decode;
2. the prefill engine answers with ``kv_transfer_params`` naming where its KV blocks wait;
3. decode leg: the client's body plus those params, verbatim; its answer goes to the client.
Both legs carry the same X-Request-Id. The direct path is step 3 without params.

Failover, only before the client has received a byte: a failed prefill leg is retried on another
prefill engine, then (if allowed) the request goes direct; a decode leg that fails before its
first token is retried on another decode engine. The retry keeps the KV handle only when the
failed engine never saw the request (connection refused): an engine that did see it may have told
the prefill engine to drop the blocks, so the retry goes direct (the decode engine prefills).
A client 4xx from an engine is its verdict on the request: never retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from policies.base import Decision, Path

from .config import FailoverConfig, TimeoutsConfig
from .errors import APIError
from .h1client import ClientError, Response
from .pools import Endpoint, Pools
from .protocol import ParsedRequest
from .requestlog import RequestRecord
from .tracing import NO_LEG, LegSpan
from .upstream import EngineError, Upstream, transport_error

log = logging.getLogger(__name__)

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Another endpoint of a pool, avoiding the urls given; None when there is none.
PickOther = Callable[[str, set[str]], Endpoint | None]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return leg


def release_body(model: str, kv_params: dict[str, Any]) -> dict[str, Any]:
    """A decode request vLLM 0.32 rejects before running it (beam search cannot stream); its
    rejection path notifies the prefill engine, which frees the held blocks at once, with no
    transfer and no compute (``_with_kv_transfer_rejection_cleanup``)."""
    return {"model": model, "prompt": "x", "max_tokens": 1, "stream": True, "use_beam_search": True,
            "kv_transfer_params": kv_params}


@dataclass
class DecodeStream:
    """The open decode response; whoever relays it must call ``close`` exactly once. ``head`` is
    what was already read of the body: all of it when not streaming, else the first chunk."""

    resp: Response
    endpoint: Endpoint
    head: bytes = b""
    path: Path = Path.DIRECT
    failover: list[str] = field(default_factory=list)  # what happened on the way, for the response
    span: LegSpan = NO_LEG

    def close(self, *, reuse: bool) -> None:
        if reuse:
            self.resp.release()
        else:  # dropping the connection is how vLLM learns to abort the request
            self.resp.close()
        self.endpoint.release()
        self.span.end(None if reuse else "decode stream cut short")


class _LegFailed(Exception):
    def __init__(self, err: APIError, reached: bool) -> None:
        super().__init__(err.message)
        self.err = err
        self.reached = reached  # the engine received the request


def _retryable(err: APIError) -> bool:
    return err.status >= 500


class Dispatcher:
    def __init__(self, upstream: Upstream, pools: Pools, timeouts: TimeoutsConfig, failover: FailoverConfig,
                 on_failover: Callable[[str, str], None] = lambda event, cause: None) -> None:
        self._upstream = upstream
        self._pools = pools
        self._timeouts = timeouts
        self._failover = failover
        self._on_failover = on_failover  # metrics
        self._background: set[asyncio.Task] = set()

    async def run(self, decision: Decision, req: ParsedRequest, path: str, rec: RequestRecord,
                  pick_other: PickOther, prefill_tokens: int = 0, decode_tokens: int = 0) -> DecodeStream:
        """``rec`` collects what happens (legs, times, failovers) for metrics, traces and logs."""
        kv_params = None
        if decision.path is Path.PD:
            assert decision.prefill is not None
            kv_params = await self._prefill_with_failover(
                self._pools.get(decision.prefill), req, path, rec, pick_other, prefill_tokens)
        try:
            up = await self._decode_with_failover(
                self._pools.get(decision.decode), req, path, rec, kv_params, pick_other, decode_tokens)
        except asyncio.CancelledError:
            if kv_params is not None:  # the client left: its prefilled KV need not wait out the lease
                self._release(self._pools.get(decision.decode), req.model, kv_params, rec.request_id)
            raise
        up.failover = rec.failover
        return up

    # -- prefill ----------------------------------------------------------------------------------

    async def _prefill_with_failover(self, ep: Endpoint, req: ParsedRequest, path: str, rec: RequestRecord,
                                     pick_other: PickOther, tokens: int) -> dict[str, Any] | None:
        tried = {ep.url}
        for attempt in range(self._failover.prefill_retries + 1):
            try:
                return await self.prefill(ep, req, path, rec, tokens)
            except EngineError as err:
                if not _retryable(err):
                    raise
                ep.record(False)
                log.warning("request %s: prefill leg on %s failed (%s)", rec.request_id, ep.url, err.message)
                other = pick_other("prefill", tried) if attempt < self._failover.prefill_retries else None
                if other is None:
                    if not self._failover.fallback_to_direct:
                        raise
                    self._event(rec, "prefill_fallback_direct", err, ep)
                    rec.prefill = ""
                    return None
                self._event(rec, "prefill_retried", err, ep)
                ep = other
                tried.add(ep.url)
        return None  # unreachable: the loop returns or raises

    async def prefill(self, ep: Endpoint, req: ParsedRequest, path: str, rec: RequestRecord, tokens: int = 0
                      ) -> dict[str, Any]:
        ticket = ep.start_prefill(tokens)
        span = rec.trace.leg("prefill", ep.url)
        span.set("pdgate.uncached_tokens", tokens)
        started = time.perf_counter()
        ok = False
        error = "cancelled"
        with _in_flight(ep):
            try:
                resp = await self._upstream.post(ep, path, prefill_body(req.body), rec.request_id, leg="prefill",
                                                 headers=span.headers)
                try:
                    data = await self._upstream.read_json(resp, "prefill")
                except BaseException:
                    resp.close()  # also on cancellation: the engine sees the connection drop and aborts
                    raise
                resp.release()
                ok = True
            except APIError as err:
                error = err.code or err.message
                raise
            finally:
                ep.end_prefill(ticket, learn=ok)
                rec.prefill_legs.append(("ok" if ok else "error", time.perf_counter() - started))
                rec.prefill = ep.url
                span.end(None if ok else error)
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise EngineError(
                502,
                "The prefill engine returned no kv_transfer_params; is it running with a KV connector "
                "such as the NixlConnector?",
                code="engine_error",
            )
        ep.record(True)
        return params  # verbatim: newer vLLM adds fields a rebuilt object would lose

    # -- decode -----------------------------------------------------------------------------------

    async def _decode_with_failover(self, ep: Endpoint, req: ParsedRequest, path: str, rec: RequestRecord,
                                    kv_params: dict[str, Any] | None, pick_other: PickOther,
                                    tokens: int) -> DecodeStream:
        tried = {ep.url}
        for attempt in range(self._failover.decode_retries + 1):
            try:
                up = await self.open_decode(ep, req, path, rec, kv_params, tokens)
                ep.record(True)
                up.path = Path.PD if kv_params is not None else Path.DIRECT
                return up
            except _LegFailed as failed:
                if not _retryable(failed.err):
                    raise failed.err from None
                ep.record(False)
                log.warning("request %s: decode leg on %s failed (%s)", rec.request_id, ep.url, failed.err.message)
                other = pick_other("decode", tried) if attempt < self._failover.decode_retries else None
                if other is None:
                    raise failed.err from None
                self._event(rec, "decode_retried", failed.err, ep)
                if failed.reached:
                    kv_params = None  # its blocks may be gone: the next engine prefills itself
                ep = other
                tried.add(ep.url)
        raise AssertionError("unreachable")

    async def open_decode(self, ep: Endpoint, req: ParsedRequest, path: str, rec: RequestRecord,
                          kv_params: dict[str, Any] | None, tokens: int = 0) -> DecodeStream:
        """Send the decode leg and read up to its first token; raises _LegFailed before that.
        A direct stream prefills ``tokens`` uncached tokens there first: they count in the
        endpoint's backlog until its first token (the cost model's queue estimate). A whole
        answer's first token cannot be seen, so non-streamed legs do not count."""
        body = req.body if kv_params is None else {**req.body, "kv_transfer_params": kv_params}
        reached = False
        span = rec.trace.leg("decode", ep.url)
        span.set("pdgate.kv_from_prefill", kv_params is not None)
        ticket = ep.start_prefill(tokens if kv_params is None and req.stream else 0)
        started = time.perf_counter()
        rec.decode = ep.url
        with _in_flight(ep) as keep:
            try:
                # decode_first_byte_s bounds this block: the decode leg's Timeouts.first, ended below.
                try:
                    resp = await self._upstream.post(ep, path, body, rec.request_id, leg="decode",
                                                     headers=span.headers)
                except EngineError as err:
                    raise _LegFailed(err, reached=err.code != "engine_unreachable") from None
                reached = True
                try:
                    head = await _read_head(resp, req.stream)
                except BaseException:
                    resp.close()
                    raise
                resp.end_first()
            except TimeoutError:
                span.end("engine_timeout")
                raise _LegFailed(EngineError(504, "The decode engine did not answer in time.",
                                             code="engine_timeout"), reached=True) from None
            except _LegFailed as failed:
                span.end(failed.err.code or failed.err.message)
                raise
            except (ClientError, _BrokenHead) as err:
                failure = err.err if isinstance(err, _BrokenHead) else transport_error(err, "decode")
                span.end(failure.code or failure.message)
                raise _LegFailed(failure, reached=reached) from None
            finally:
                # Not learned from: a first token's time on a decode engine also holds the running
                # decodes' step time, which would bias the per-token speed the cost model uses.
                ep.end_prefill(ticket, learn=False)
            keep()  # the relay now owns the in-flight count
        if req.stream:
            rec.decode_first_token_s = time.perf_counter() - started
            span.set("pdgate.first_token_s", rec.decode_first_token_s)
        return DecodeStream(resp, ep, head, span=span)

    # -- releasing stranded KV ----------------------------------------------------------------------

    def _release(self, ep: Endpoint, model: str, kv_params: dict[str, Any], request_id: str) -> None:
        async def release() -> None:
            try:
                async with asyncio.timeout(5):
                    resp = await self._upstream.post(ep, "/v1/completions", release_body(model, kv_params),
                                                     f"{request_id}-release", leg="decode")
                    resp.close()
            except (EngineError, TimeoutError, ClientError):
                pass  # the 400 we expect is an EngineError: the rejection did its work
        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _event(self, rec: RequestRecord, event: str, err: APIError, ep: Endpoint) -> None:
        cause = err.code or "engine_error"
        rec.failover.append(event)
        rec.trace.event(event, {"pdgate.cause": cause, "pdgate.failed_endpoint": ep.url})
        self._on_failover(event, cause)


class _BrokenHead(Exception):
    def __init__(self, err: APIError) -> None:
        super().__init__(err.message)
        self.err = err


async def _read_head(resp: Response, stream: bool) -> bytes:
    """The whole body (not streaming) or the first chunk of the stream. A stream that ends at
    once, or opens with an error event (vLLM 0.32 reports a failed KV load so), has failed before
    its first token: the caller may still retry it."""
    if not stream:
        return await resp.read()
    head = await resp.read_some()
    if not head or head.lstrip().startswith(b'data: {"error"'):
        raise _BrokenHead(EngineError(502, "The decode engine failed before its first token.", code="engine_error"))
    return head


@contextmanager
def _in_flight(ep: Endpoint) -> Iterator[Callable[[], None]]:
    """Count a request on ``ep`` until the block ends, unless ``keep()`` hands the count on."""
    ep.acquire()
    kept = False

    def keep() -> None:
        nonlocal kept
        kept = True

    try:
        yield keep
    finally:
        if not kept:
            ep.release()
