"""HTTP to the engines: pooled keep-alive connections, per-leg timeouts, errors in client terms.

The engine legs go through an ``EngineTransport`` (gateway/engines/transport.py), by default the gateway's
own HTTP/1.1 client (``h1client``): against an instant local server it costs a fraction of
aiohttp's CPU per request (docs/benchmarks.md, "Upstream HTTP client"), and that cost is most of
what the gateway adds to a request. ``engines.transport: aiohttp`` selects the reference
implementation instead. The health checker keeps using an aiohttp session.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any, Literal

import aiohttp
import orjson

from gateway.config import EnginesConfig, TimeoutsConfig
from gateway.engines.h1client import H1Client
from gateway.engines.pools import Endpoint
from gateway.engines.transport import (
    ClientError,
    ConnectError,
    EngineResponse,
    EngineTransport,
    FirstTimeout,
    ServerDisconnected,
    Timeouts,
    tls_context,
)
from gateway.engines.transport_aiohttp import AiohttpTransport
from gateway.http.errors import APIError, bad_request, clip

log = logging.getLogger(__name__)

Leg = Literal["prefill", "decode"]
# A prefill answer is one token plus the KV handle; an error body is a message. Anything bigger
# is not an engine talking sense, and is not read into memory.
MAX_JSON_BYTES = 1 << 20
# vLLM (uvicorn) drops idle keep-alive connections after 5 s; reusing one it is closing would fail
# a request for nothing.
KEEPALIVE_S = 4.0


def make_session(engines: EnginesConfig | None = None) -> aiohttp.ClientSession:
    """The aiohttp session for the control plane (health checks and the like), not the engine legs;
    with ``engines``, it talks TLS to https engines as the legs do (its CA and client certificate)."""
    tls = _engines_tls(engines or EnginesConfig())
    connector = aiohttp.TCPConnector(
        limit=0,
        ttl_dns_cache=300,
        keepalive_timeout=KEEPALIVE_S,
        enable_cleanup_closed=True,
        ssl=tls if tls is not None else True,
    )
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, raise_for_status=False, skip_auto_headers=("Accept-Encoding",)
    )


def make_client(cfg: EnginesConfig | None = None) -> EngineTransport:
    """The engine legs' HTTP client as ``cfg`` (default: ``h1``, system CAs) says; ``close`` it at
    shutdown. Raises OSError/ssl.SSLError if a configured CA or certificate file cannot be used."""
    cfg = cfg or EnginesConfig()
    kind = AiohttpTransport if cfg.transport == "aiohttp" else H1Client
    return kind(keepalive_s=KEEPALIVE_S, tls=_engines_tls(cfg))


def _engines_tls(cfg: EnginesConfig) -> ssl.SSLContext | None:
    """The configured TLS context for https engines; None: the system's CAs, no client certificate."""
    return tls_context(cfg.ca_file, cfg.cert_file, cfg.key_file) if cfg.ca_file or cfg.cert_file else None


class EngineError(APIError):
    """An engine answered with an error status, or could not be reached."""


class EngineGone(EngineError):
    """The engine closed the connection before its first byte (a process killed while it had the
    request): counted as ``engine_unreachable``, as the next connect will be, yet the engine had
    the request and may have begun on it (a decode leg may have pulled the prompt's KV)."""


class Upstream:
    """The engine legs, over ``client``: a transport that outlives config versions, so reloads
    keep the warm connections. Given none, it opens a default one of its own, which ``close``
    closes."""

    def __init__(self, client: EngineTransport | None, timeouts: TimeoutsConfig) -> None:
        self._own_client = client is None
        self._client = make_client() if client is None else client
        self._timeouts: dict[Leg, Timeouts] = {
            "prefill": Timeouts(connect=timeouts.connect_s, total=timeouts.prefill_s),
            # No total: a decode stream lasts as long as it generates; only silence is an error.
            # ``first``: until the first token (the dispatcher calls ``end_first`` then).
            "decode": Timeouts(
                connect=timeouts.connect_s, idle=timeouts.decode_idle_s, first=timeouts.decode_first_byte_s
            ),
        }

    async def post(
        self,
        ep: Endpoint,
        path: str,
        body: dict[str, Any],
        request_id: str,
        *,
        leg: Leg,
        headers: dict[str, str] | None = None,
    ) -> EngineResponse:
        """Send ``body`` and return the open response (status checked); the caller ends it with
        ``release`` or ``close``. ``headers``: the leg's trace context (traceparent), if any."""
        try:
            data = orjson.dumps(body)
        except orjson.JSONEncodeError as err:  # e.g. nesting deeper than the encoder takes
            raise bad_request(f"The request body cannot be forwarded: {err}.") from None
        try:
            fields = {"Content-Type": "application/json", "X-Request-Id": request_id}
            if headers:
                fields.update(headers)
            resp = await self._client.post(ep.url, path, data, fields, self._timeouts[leg])
        except ConnectError as err:
            ep.mark_down(f"connect failed: {err.os_error}")
            raise EngineError(502, f"Could not reach a {leg} engine.", code="engine_unreachable") from None
        except ServerDisconnected:
            raise EngineGone(
                502, f"The {leg} engine closed the connection before answering.", code="engine_unreachable"
            ) from None
        except (TimeoutError, ClientError) as err:
            raise transport_error(err, leg) from None
        if resp.status >= 400:
            try:
                raw = await read_capped(resp)
            except FirstTimeout:
                raise  # the leg's first-byte deadline: the caller's timeout, not this error's detail
            except (TimeoutError, ClientError, EngineError):
                raw = b""
            finally:
                resp.close()
            raise _engine_error(resp.status, raw, leg, ep)
        return resp

    async def read_json(self, resp: EngineResponse, leg: Leg) -> dict[str, Any]:
        try:
            raw = await read_capped(resp)
        except (TimeoutError, ClientError) as err:
            raise transport_error(err, leg) from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise EngineError(
                502, f"The {leg} engine answered with something that is not a JSON object.", code="engine_error"
            )
        return data

    def close(self) -> None:
        """Drop the engine connections of a client this Upstream opened itself."""
        if self._own_client:
            self._client.close()


async def read_capped(resp: EngineResponse, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole body, or an EngineError once it passes ``limit`` bytes."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise EngineError(502, "An engine answered with an oversized body.", code="engine_error")
    chunks, size = [], 0
    while chunk := await resp.read_some():
        size += len(chunk)
        if size > limit:
            raise EngineError(502, "An engine answered with an oversized body.", code="engine_error")
        chunks.append(chunk)
    return b"".join(chunks)


def transport_error(err: BaseException, leg: Leg) -> EngineError:
    if isinstance(err, TimeoutError):
        return EngineError(504, f"The {leg} engine did not answer in time.", code="engine_timeout")
    return EngineError(502, f"The {leg} engine failed: {type(err).__name__}.", code="engine_error")


def _engine_error(status: int, raw: bytes, leg: Leg, ep: Endpoint) -> EngineError:
    """4xx: the engine judged the request, so its verdict goes through unchanged. 5xx: the
    details (which may name hosts) go to the log, the client gets a generic message."""
    message = ""
    try:
        data = orjson.loads(raw)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            message = str(err.get("message", ""))
        elif isinstance(data, dict):
            message = str(data.get("message") or data.get("detail") or "")
    except orjson.JSONDecodeError:
        message = raw[:500].decode("utf-8", "replace")
    if 400 <= status < 500:
        return EngineError(status, message or f"The {leg} engine rejected the request.", code="engine_rejected")
    log.warning("%s engine %s answered HTTP %d: %s", leg, ep.url, status, clip(message, 500) or "(no body)")
    return EngineError(502, f"The {leg} engine failed (HTTP {status}).", code="engine_error")
