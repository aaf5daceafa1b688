"""One engine leg at a time: what goes on the wire to a prefill or decode engine, and what comes back.

vLLM's NixlConnector handshake (the README's "How a request flows", step 4):

1. prefill leg: the client's body, non-streaming, one output token, asking for remote decode;
2. the prefill engine answers with ``kv_transfer_params`` naming where its KV blocks wait;
3. decode leg: the client's body plus those params, verbatim; its answer goes to the client.

The direct path is step 3 without params. This module only does the I/O of one leg; which engine,
retries and accounting belong to the request's ``EngineLegs`` (gateway/request/engine_legs.py), which
the request's ``Exchange`` drives; learning, to the policies' lifecycle hooks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.background import STOP_BOUND_S, stop_tasks
from gateway.engines import sse
from gateway.engines.pools import Endpoint
from gateway.engines.transport import ClientError
from gateway.engines.transport import EngineResponse as Response  # what every transport returns
from gateway.engines.upstream import EngineError, EngineGone, Upstream, transport_error
from gateway.http.errors import APIError

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    # No token ids back: the prefill answer goes nowhere but here, and they would echo the prompt.
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "return_token_ids")}
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
    return {
        "model": model,
        "prompt": "x",
        "max_tokens": 1,
        "stream": True,
        "use_beam_search": True,
        "kv_transfer_params": kv_params,
    }


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    kv_params: dict[str, Any]  # verbatim: newer vLLM adds fields a rebuilt object would lose
    cached_tokens: int | None  # the prefill engine's own prefix-cache hit, as it reports it


class LegFailed(Exception):
    """A leg failed before the client got a byte of it; ``reached``: the engine got the request."""

    def __init__(self, err: APIError, reached: bool) -> None:
        super().__init__(err.message)
        self.err = err
        self.reached = reached


def retryable(err: APIError) -> bool:
    """An engine's 4xx is its verdict on the request: another engine would say the same."""
    return err.status >= 500


async def prefill(
    upstream: Upstream, ep: Endpoint, path: str, body: dict[str, Any], request_id: str, headers: dict[str, str]
) -> PrefillAnswer:
    """Steps 1 and 2; raises LegFailed."""
    try:
        resp = await upstream.post(ep, path, prefill_body(body), request_id, leg="prefill", headers=headers)
    except EngineError as err:
        raise LegFailed(err, reached=_had_request(err)) from None
    try:
        data = await upstream.read_json(resp, "prefill")
    except EngineError as err:
        resp.close()
        raise LegFailed(err, reached=True) from None
    except BaseException:
        resp.close()  # also on cancellation: the engine sees the connection drop and aborts
        raise
    resp.release()
    params = data.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise LegFailed(
            EngineError(
                502,
                "The prefill engine returned no kv_transfer_params; is it running with a KV connector "
                "such as the NixlConnector?",
                code="engine_error",
            ),
            reached=True,
        )
    if not _sendable(params):
        raise LegFailed(
            EngineError(
                502, "The prefill engine returned kv_transfer_params that cannot be sent on.", code="engine_error"
            ),
            reached=True,
        )
    return PrefillAnswer(params, _prefill_cached(params, data))


def _sendable(params: dict[str, Any]) -> bool:
    """Whether the decode leg (and a release) can carry ``params``: orjson reads JSON nested up to
    1024 levels but writes only 254, and a handle too deep to send on is the prefill engine's fault,
    not a 400 for the client's request (Upstream.post). Checked at the depth the decode body holds it."""
    try:
        orjson.dumps({"kv_transfer_params": params})
    except orjson.JSONEncodeError:
        return False
    return True


def _prefill_cached(params: dict[str, Any], data: dict[str, Any]) -> int | None:
    """vLLM puts the prefill engine's cache hit in the handle (``remote_prefill_cached_tokens``,
    so the decode engine can report it), and in usage with ``--enable-prompt-tokens-details``."""
    cached = params.get("remote_prefill_cached_tokens")
    if type(cached) is int:
        return cached
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int else None


@dataclass(slots=True)
class DecodeStream:
    """The open decode response. ``head``: what was already read of the body (all of it when not
    streaming, else the first chunk)."""

    resp: Response
    head: bytes

    def close(self, *, reuse: bool) -> None:
        if reuse:
            self.resp.release()
        else:  # dropping the connection is how vLLM learns to abort the request
            self.resp.close()


async def open_decode(
    upstream: Upstream,
    ep: Endpoint,
    path: str,
    body: dict[str, Any],
    request_id: str,
    stream: bool,
    headers: dict[str, str],
    *,
    max_head_bytes: int = 0,
) -> DecodeStream:
    """Step 3 up to the first token (a stream) or the whole answer; raises LegFailed before that.
    ``timeouts.decode_first_byte_s`` bounds this: the transport's first-byte timer, ended here.
    ``max_head_bytes``: read a stream up to its first whole event after the chat role chunk (a
    migratable answer's first token), failing past this many bytes; 0: the first bytes are enough."""
    try:
        resp = await upstream.post(ep, path, body, request_id, leg="decode", headers=headers)
    except EngineError as err:
        raise LegFailed(err, reached=_had_request(err)) from None
    except TimeoutError:
        raise LegFailed(_timed_out(), reached=True) from None
    try:
        head = await _read_head(resp, stream, max_head_bytes)
    except BaseException as err:
        resp.close()
        if isinstance(err, TimeoutError):
            raise LegFailed(_timed_out(), reached=True) from None
        if isinstance(err, ClientError):
            raise LegFailed(transport_error(err, "decode"), reached=True) from None
        raise
    resp.end_first()
    return DecodeStream(resp, head)


def _timed_out() -> EngineError:
    return EngineError(504, "The decode engine did not answer in time.", code="engine_timeout")


async def _read_head(resp: Response, stream: bool, max_head_bytes: int = 0) -> bytes:
    """The whole body (not streaming) or the start of the stream (see ``open_decode``). A stream
    that ends at once, or whose first event after the chat role chunk is an error (vLLM 0.32
    reports a failed KV load so), has failed before its first token: the caller may still retry."""
    if not stream:
        return await resp.read()
    head = await resp.read_some()
    while max_head_bytes and head and _before_token(head):  # vLLM sends the role chunk just before
        if len(head) > max_head_bytes:
            raise LegFailed(
                EngineError(502, "The decode engine sent an oversized event.", code="engine_error"), reached=True
            )
        more = await resp.read_some()
        if not more:
            break
        head += more
    if not head or _error_first(head):
        raise LegFailed(
            EngineError(502, "The decode engine failed before its first token.", code="engine_error"), reached=True
        )
    return head


def _before_token(head: bytes) -> bool:
    """No whole event yet but chat role chunks (``"delta":{"role":...}``) and comments: the first
    token (or a failure) is still to come."""
    return all(b'"delta":{"role"' in p for p in sse.payloads(head))


def _error_first(head: bytes) -> bool:
    """The first event after any role chunk (the last one perhaps still arriving) is an error."""
    for payload in sse.payloads(head, arriving=True):
        if payload.startswith(b'{"error"'):
            return True
        if b'"delta":{"role"' not in payload:
            return False
    return False


class KVReleaser:
    """Frees KV a prefill engine holds for a decode that will never come (the client left between
    the legs), instead of letting it wait out the lease; background tasks, bounded in time."""

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, ep: Endpoint, model: str, kv_params: dict[str, Any], request_id: str) -> None:
        async def release() -> None:
            try:
                async with asyncio.timeout(5):
                    resp = await self._upstream.post(
                        ep, "/v1/completions", release_body(model, kv_params), f"{request_id}-release", leg="decode"
                    )
                    resp.close()
            except (APIError, TimeoutError, ClientError):
                # the 400 we expect is an EngineError: the rejection did its work; any other APIError
                # (a body Upstream.post cannot send) only leaves the blocks to their lease, and a
                # background task's exception would go unretrieved
                pass

        task = asyncio.get_running_loop().create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, bound_s: float = STOP_BOUND_S) -> None:
        """Cancel the releases still out, within ``bound_s`` (shutdown): an abandoned one only
        means the prefill engine holds those blocks until its KV lease runs out."""
        await stop_tasks(list(self._tasks), bound_s=bound_s)


def _had_request(err: EngineError) -> bool:
    """Whether the engine got the request: all but a refused connection (``EngineGone`` counts as
    unreachable, yet it had the request)."""
    return isinstance(err, EngineGone) or err.code != "engine_unreachable"
