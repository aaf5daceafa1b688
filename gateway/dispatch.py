"""The P/D handshake with vLLM's NixlConnector (DESIGN.md, "The P/D handshake").

1. prefill leg: the client's body, non-streaming, one output token, asking for remote decode;
2. the prefill engine answers with ``kv_transfer_params`` naming where its KV blocks wait;
3. decode leg: the client's body plus those params, verbatim; its answer goes to the client.
Both legs carry the same X-Request-Id. The direct path is step 3 without params.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from policies.base import Decision, Path

from .errors import APIError
from .pools import Endpoint, Pools
from .protocol import ParsedRequest
from .upstream import Upstream

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return leg


@dataclass
class DecodeStream:
    """The open decode response; whoever relays it must call ``close`` exactly once."""

    resp: aiohttp.ClientResponse
    endpoint: Endpoint

    def close(self, *, reuse: bool) -> None:
        if reuse:
            self.resp.release()
        else:  # dropping the connection is how vLLM learns to abort the request
            self.resp.close()
        self.endpoint.release()


class Dispatcher:
    def __init__(self, upstream: Upstream, pools: Pools) -> None:
        self._upstream = upstream
        self._pools = pools

    async def run(self, decision: Decision, req: ParsedRequest, path: str, request_id: str) -> DecodeStream:
        kv_params = None
        if decision.path is Path.PD:
            assert decision.prefill is not None
            kv_params = await self.prefill(self._pools.get(decision.prefill), req, path, request_id)
        return await self.open_decode(self._pools.get(decision.decode), req, path, request_id, kv_params)

    async def prefill(self, ep: Endpoint, req: ParsedRequest, path: str, request_id: str) -> dict[str, Any]:
        with _in_flight(ep):
            resp = await self._upstream.post(ep, path, prefill_body(req.body), request_id, leg="prefill")
            try:
                data = await self._upstream.read_json(resp, "prefill")
            except BaseException:
                resp.close()  # also on cancellation: the engine sees the connection drop and aborts
                raise
            resp.release()
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise APIError(
                502,
                "The prefill engine returned no kv_transfer_params; is it running with a KV connector "
                "such as the NixlConnector?",
                code="engine_error",
            )
        return params  # verbatim: newer vLLM adds fields a rebuilt object would lose

    async def open_decode(
        self, ep: Endpoint, req: ParsedRequest, path: str, request_id: str, kv_params: dict[str, Any] | None
    ) -> DecodeStream:
        body = req.body if kv_params is None else {**req.body, "kv_transfer_params": kv_params}
        with _in_flight(ep) as keep:
            resp = await self._upstream.post(ep, path, body, request_id, leg="decode")
            keep()  # the relay now owns the in-flight count
        return DecodeStream(resp, ep)


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
