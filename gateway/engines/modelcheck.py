"""Which models each engine serves, from its own ``GET /v1/models``, against the configured names.

Checked when the gateway starts, on every config reload, whenever an engine comes (back) up, and
every ``lora.refresh_s`` (LoRA adapters are loaded and unloaded at run time; the adapter cards'
``root`` and ``parent`` say where each was loaded from and of which base model):
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

from gateway.background import cancel_checkpoint, stop_task
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
        self.refresh_s = 10.0
        self._task: asyncio.Task[None] | None = None

    def configure(self, configured: Sequence[str], timeout_s: float, refresh_s: float | None = None) -> None:
        self.configured = tuple(configured)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        if refresh_s is not None:
            self.refresh_s = refresh_s

    async def check(self, ep: Endpoint) -> None:
        """Ask ``ep`` what it serves; on failure, or an answer that is not a model list, what it
        said before stays (or stays unknown). Never raises for what the engine sent: it is asked
        on the way up (``HealthChecker`` on_up), where an error would keep the engine down."""
        try:
            async with self._session.get(ep.url + "/v1/models", timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                data = orjson.loads(await resp.content.read(MAX_BODY_BYTES))
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as err:
            log.debug("GET %s/v1/models failed: %s", ep.url, type(err).__name__)
            return
        listed = data.get("data") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            # Valid JSON, but not a model list ({"data": null}, a bare list...): as unreadable as a
            # failed answer, not "serves nothing"; raising here would keep the engine from coming up.
            log.debug("GET %s/v1/models failed: not a model list", ep.url)
            return
        cards = [m for m in listed if isinstance(m, dict)]  # a card that is not an object names nothing
        names = frozenset(n for m in cards if isinstance(n := m.get("id"), str))
        self._pools.set_served(ep, names, _adapters(cards))
        self._log_change(ep)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(ep) for ep in self._pools.all()))
        for ep in self._pools.all():
            self._log_change(ep)  # a reload may change the configured names, not the engines

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await asyncio.gather(*(self.check(ep) for ep in self._pools.all() if ep.healthy))
            except Exception:  # one bad round must not end the refreshes (not BaseException)
                log.exception("model list refresh failed")
            cancel_checkpoint()

    def start(self) -> None:
        """Read every engine's list again each ``refresh_s``: adapters come and go at run time."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._refresh(), name="model-lists")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

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


MAX_ADAPTERS = 4096  # adapter cards read from one engine's list


def _adapters(cards: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """The list's LoRA adapters, as vLLM writes their cards: name -> (the path it loaded them
    from, ``root``; the base model, ``parent``). A base model's card has no parent."""
    found: dict[str, tuple[str, str]] = {}
    for m in cards:
        name, root, parent = m.get("id"), m.get("root"), m.get("parent")
        if isinstance(name, str) and isinstance(root, str) and isinstance(parent, str) and len(found) < MAX_ADAPTERS:
            found[name] = (root, parent)
    return found
