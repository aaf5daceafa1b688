"""Which models each engine serves, from its own ``GET /v1/models``, against the configured names.

Checked when the gateway starts, on every config reload, and whenever an engine comes (back) up:
a mismatch shows in ``/ready`` (the names on both sides), in ``pdgate_endpoint_model_missing`` and
in the log, instead of as 404s at request time. Routing leaves out an engine known not to serve a
request's model (``Endpoint.served_models``); an engine not checked yet is not left out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from gateway.engines.pools import Endpoint, Pools

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a model list, not a stream: anything larger is not an engine talking sense


class ServedModels:
    def __init__(
        self, pools: Pools, session: aiohttp.ClientSession, configured: Sequence[str], timeout_s: float = 5.0
    ) -> None:
        self._pools = pools
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.configured: tuple[str, ...] = tuple(configured)
        self._reported: dict[tuple[str, str], tuple[str, ...]] = {}  # (pool, url) -> the missing names logged

    def configure(self, configured: Sequence[str], timeout_s: float) -> None:
        self.configured = tuple(configured)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def check(self, ep: Endpoint) -> None:
        """Ask ``ep`` what it serves; on failure what it said before stays (or stays unknown)."""
        try:
            async with self._session.get(ep.url + "/v1/models", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                data = orjson.loads(await resp.content.read(MAX_BODY_BYTES))
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as err:
            log.debug("GET %s/v1/models failed: %s", ep.url, type(err).__name__)
            return
        names = {m.get("id") for m in data.get("data", ()) if isinstance(m, dict)} if isinstance(data, dict) else set()
        self._pools.set_served(ep, frozenset(n for n in names if isinstance(n, str)))
        self._log_change(ep)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(ep) for ep in self._pools.all()))
        for ep in self._pools.all():
            self._log_change(ep)  # a reload may change the configured names, not the engines

    def missing(self, ep: Endpoint) -> list[str]:
        """Configured names the engine does not serve ([] while not known)."""
        if ep.served_models is None:
            return []
        return [m for m in self.configured if m not in ep.served_models]

    def _log_change(self, ep: Endpoint) -> None:
        missing = tuple(self.missing(ep))
        key = (ep.pool, ep.url)
        if self._reported.get(key, ()) == missing:
            return
        self._reported[key] = missing
        if missing:
            log.warning(
                "%s engine %s does not serve %s (it serves %s): requests for %s go to other engines",
                ep.pool,
                ep.url,
                ", ".join(missing),
                ", ".join(sorted(ep.served_models or ())) or "nothing",
                "them" if len(missing) > 1 else "it",
            )
        else:
            log.info("%s engine %s serves every configured model", ep.pool, ep.url)

    def status(self) -> dict[str, Any]:
        """For ``/ready``: the configured names, and every engine that lacks one of them."""
        mismatched = [
            {"pool": ep.pool, "engine": ep.url, "missing": missing, "served": sorted(ep.served_models or ())}
            for ep in self._pools.all()
            if (missing := self.missing(ep))
        ]
        unknown = [ep.url for ep in self._pools.all() if ep.served_models is None]
        return {"configured": list(self.configured), "mismatched": mismatched, "unchecked": unknown}
