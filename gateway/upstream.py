"""HTTP to the engines: one pooled aiohttp session, per-leg timeouts, errors in client terms.

aiohttp rather than httpx on this path: against an instant local server it costs ~95 us per
request where httpx costs ~500 us (bench notes in the README).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from .config import TimeoutsConfig
from .errors import APIError
from .pools import Endpoint


def make_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    # Engines answer with their own JSON; never let aiohttp raise on status or decompress twice.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, raise_for_status=False)


class EngineError(APIError):
    """An engine answered with an error status, or could not be reached."""


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, timeouts: TimeoutsConfig) -> None:
        self.session = session
        self._prefill_timeout = aiohttp.ClientTimeout(total=timeouts.prefill_s, sock_connect=timeouts.connect_s)
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.decode_idle_s
        )

    async def post(
        self, ep: Endpoint, path: str, body: dict[str, Any], request_id: str, *, leg: str
    ) -> aiohttp.ClientResponse:
        """Send ``body`` and return the open response (status checked); the caller closes it."""
        timeout = self._prefill_timeout if leg == "prefill" else self._decode_timeout
        try:
            resp = await self.session.post(
                ep.url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                timeout=timeout,
            )
        except aiohttp.ClientConnectorError as err:
            ep.mark_down(f"connect failed: {err.os_error or err}")
            raise EngineError(502, f"Could not reach a {leg} engine.", code="engine_unreachable") from None
        except (TimeoutError, aiohttp.ClientError) as err:
            raise transport_error(err, leg) from None
        if resp.status >= 400:
            try:
                raw = await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                raw = b""
            finally:
                resp.close()
            raise _engine_error(resp.status, raw, leg)
        return resp

    async def read_json(self, resp: aiohttp.ClientResponse, leg: str) -> dict[str, Any]:
        try:
            raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as err:
            raise transport_error(err, leg) from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise EngineError(502, f"The {leg} engine answered with something that is not a JSON object.",
                              code="engine_error")
        return data


def transport_error(err: BaseException, leg: str) -> EngineError:
    if isinstance(err, asyncio.TimeoutError):
        return EngineError(504, f"The {leg} engine did not answer in time.", code="engine_timeout")
    return EngineError(502, f"The {leg} engine failed: {type(err).__name__}.", code="engine_error")


def _engine_error(status: int, raw: bytes, leg: str) -> EngineError:
    """Keep the engine's own message (it explains bad requests) but never its internals' status."""
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
        # The engine judged the request itself: hand its verdict through unchanged.
        return EngineError(status, message or f"The {leg} engine rejected the request.", code="engine_rejected")
    detail = f": {message}" if message else ""
    return EngineError(502, f"The {leg} engine failed (HTTP {status}){detail}", code="engine_error")
