"""HTTP to the engines: one pooled aiohttp session, per-leg timeouts, errors in client terms.

aiohttp rather than httpx on this path: against an instant local server it costs ~95 us per
request where httpx costs ~500 us (bench notes in the README).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import aiohttp
import orjson

from .config import TimeoutsConfig
from .errors import APIError, bad_request
from .pools import Endpoint

log = logging.getLogger(__name__)

Leg = Literal["prefill", "decode"]
# A prefill answer is one token plus the KV handle; an error body is a message. Anything bigger
# is not an engine talking sense, and is not read into memory.
MAX_JSON_BYTES = 1 << 20


def make_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0,
        ttl_dns_cache=300,
        # vLLM (uvicorn) drops idle keep-alive connections after 5 s; reusing one it is closing
        # would fail a request for nothing.
        keepalive_timeout=4,
        enable_cleanup_closed=True,
    )
    # Bytes are relayed as the engine sent them: no decompression, so none may be asked for.
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, raise_for_status=False, skip_auto_headers=("Accept-Encoding",)
    )


class EngineError(APIError):
    """An engine answered with an error status, or could not be reached."""


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, timeouts: TimeoutsConfig) -> None:
        self.session = session
        self._timeouts: dict[Leg, aiohttp.ClientTimeout] = {
            "prefill": aiohttp.ClientTimeout(
                total=timeouts.prefill_s, connect=timeouts.connect_s, sock_connect=timeouts.connect_s
            ),
            # No total: a decode stream lasts as long as it generates; only silence is an error.
            "decode": aiohttp.ClientTimeout(
                total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s,
                sock_read=timeouts.decode_idle_s,
            ),
        }

    async def post(self, ep: Endpoint, path: str, body: dict[str, Any], request_id: str, *, leg: Leg
                   ) -> aiohttp.ClientResponse:
        """Send ``body`` and return the open response (status checked); the caller closes it."""
        try:
            data = orjson.dumps(body)
        except orjson.JSONEncodeError as err:  # e.g. nesting deeper than the encoder takes
            raise bad_request(f"The request body cannot be forwarded: {err}.") from None
        try:
            resp = await self.session.post(
                ep.url + path,
                data=data,
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                timeout=self._timeouts[leg],
            )
        except aiohttp.ClientConnectorError as err:
            ep.mark_down(f"connect failed: {err.os_error or err}")
            raise EngineError(502, f"Could not reach a {leg} engine.", code="engine_unreachable") from None
        except (TimeoutError, aiohttp.ClientError) as err:
            raise transport_error(err, leg) from None
        if resp.status >= 400:
            try:
                raw = await read_capped(resp)
            except (TimeoutError, aiohttp.ClientError, EngineError):
                raw = b""
            finally:
                resp.close()
            raise _engine_error(resp.status, raw, leg, ep)
        return resp

    async def read_json(self, resp: aiohttp.ClientResponse, leg: Leg) -> dict[str, Any]:
        try:
            raw = await read_capped(resp)
        except (TimeoutError, aiohttp.ClientError) as err:
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


async def read_capped(resp: aiohttp.ClientResponse, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole body, or an EngineError once it passes ``limit`` bytes."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise EngineError(502, "An engine answered with an oversized body.", code="engine_error")
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise EngineError(502, "An engine answered with an oversized body.", code="engine_error")
        chunks.append(chunk)
    return b"".join(chunks)


def transport_error(err: BaseException, leg: Leg) -> EngineError:
    if isinstance(err, asyncio.TimeoutError):
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
    log.warning("%s engine %s answered HTTP %d: %s", leg, ep.url, status, message or "(no body)")
    return EngineError(502, f"The {leg} engine failed (HTTP {status}).", code="engine_error")
