"""Engine discovery through the Kubernetes API: EndpointSlices (discovery.k8s.io/v1) by label selector.

Each pool with a ``discovery`` section gets one ``SliceWatcher``: it lists the matching slices (page
by page, following ``continue``), then watches from the list's resourceVersion (``watch=1``,
bookmarks on), renewing the watch when the server ends it. Only 410 Gone (as an HTTP status or as an
ERROR event: the resourceVersion is too old) starts over with a fresh list, after a short pause; any
other failure of a watch re-watches from the last resourceVersion seen after a growing pause (a
failed list is retried the same way). The pool's discovered endpoints are the ready endpoints
(``conditions.ready`` true or unset, as the API says to read it) of every matching slice of the
configured address family (``address_type``: a dual-stack Service has one IPv4 and one IPv6 slice
per pod set, and counting both would list each pod twice): the first address of each, with the
configured port. ``Discovery`` adds them to the static endpoints of the config in force
(``effective``) and tells the app when the set changes, which then updates the pools the way a
config reload does. A watcher replaced by a reload (its discovery section changed) hands its
endpoints to its successor, which keeps them until its own first list completes.

Everything runs on the event loop without blocking it: HTTP through aiohttp, the token and CA files
read on a worker thread (the token again on every connection: projected tokens rotate).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .config import DiscoveryConfig, EndpointConfig, GatewayConfig
from .tasks import cancel_checkpoint, stop_task

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
_LIST_LIMIT = 500  # slices per list page


class Gone(Exception):
    """410: the resourceVersion is no longer served; list again."""


class APIError(Exception):
    """The API answered something other than what a list or watch expects."""


@dataclass(frozen=True)
class Access:
    """How to reach the API server: base URL, TLS context, token file and namespace."""

    url: str
    ssl: ssl.SSLContext | None
    token_file: str | None
    namespace: str


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8").strip()


def _access(cfg: DiscoveryConfig) -> Access:
    """Blocking (reads files): call it on a worker thread."""
    url = cfg.api_url
    if url is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("discovery: no api_url and KUBERNETES_SERVICE_HOST is not set (not in a pod?)")
        url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    ctx = None
    if url.startswith("https://"):
        ctx = ssl.create_default_context(cafile=cfg.ca_file if cfg.ca_file and Path(cfg.ca_file).exists() else None)
    namespace = cfg.namespace or _read(cfg.namespace_file)
    return Access(url, ctx, cfg.token_file, namespace)


def _host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" or ":" in address else address


def _port(slice_: dict[str, Any], want: int | str | None) -> int | None:
    if isinstance(want, int):
        return want
    ports = [p for p in slice_.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    if want is None:
        return int(ports[0]["port"]) if ports else None
    return next((int(p["port"]) for p in ports if p.get("name") == want), None)


def ready_endpoints(slices: dict[str, dict[str, Any]], cfg: DiscoveryConfig) -> tuple[EndpointConfig, ...]:
    """The ready endpoints of ``slices`` as the pool's endpoint configs, sorted by URL."""
    found: dict[str, EndpointConfig] = {}
    for slice_ in slices.values():
        address_type = slice_.get("addressType", "IPv4")
        if address_type != cfg.address_type:  # the other family of a dual-stack Service, or FQDN
            continue
        port = _port(slice_, cfg.port)
        if port is None:
            continue
        for ep in slice_.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            addresses = ep.get("addresses") or []
            if ready is False or not addresses:  # unset means ready (the API's own reading)
                continue
            host = _host(addresses[0], address_type)  # several addresses are fungible: the first
            url = f"{cfg.scheme}://{host}:{port}"
            found[url] = EndpointConfig(
                url=url,
                kv_events=f"tcp://{host}:{cfg.kv_events_port}" if cfg.kv_events_port else None,
                kv_events_replay=f"tcp://{host}:{cfg.kv_events_replay_port}" if cfg.kv_events_replay_port else None,
                kv_events_topic=cfg.kv_events_topic,
            )
    return tuple(found[u] for u in sorted(found))


class SliceWatcher:
    """Follows the EndpointSlices of one pool; ``on_change()`` runs when its ready set changes."""

    def __init__(self, pool: str, cfg: DiscoveryConfig, on_change: Callable[[], None],
                 endpoints: tuple[EndpointConfig, ...] = ()) -> None:
        self.pool = pool
        self.cfg = cfg
        self._on_change = on_change
        # what the pool has until the first list: () or, after a reload, the replaced watcher's set
        self.endpoints: tuple[EndpointConfig, ...] = endpoints
        self.synced = asyncio.Event()  # set after the first successful list
        self.lists = 0  # full lists done (the first, and one after each 410)
        self.errors = 0
        self.last_error = ""
        self.resource_version: str | None = None
        self._slices: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"discovery-{self.pool}")

    async def stop(self) -> None:
        """Bounded (gateway/tasks.py): a hung API connection or a swallowed cancel cannot hang
        shutdown or a reload."""
        task, self._task = self._task, None
        await stop_task(task)

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self.cfg.retry_s
        while True:
            try:
                access = await asyncio.to_thread(_access, self.cfg)
                break
            except (OSError, ValueError, ssl.SSLError) as err:  # e.g. the service account not mounted
                self._failed(f"cannot set up API access: {err}")
                log.error("discovery (%s): %s; retrying in %.1f s", self.pool, self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)
        backoff = self.cfg.retry_s
        path = f"/apis/discovery.k8s.io/v1/namespaces/{access.namespace}/endpointslices"
        connector = aiohttp.TCPConnector(ssl=access.ssl if access.ssl is not None else True)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            listed = False  # False: the next step is a full list (at the start and after a 410)
            while True:
                cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/tasks.py)
                try:
                    if not listed:
                        await self._list(access, path)
                        listed = True
                        backoff = self.cfg.retry_s
                    started = asyncio.get_running_loop().time()
                    await self._watch(access, path)  # returns when the server ends the watch
                    backoff = self.cfg.retry_s
                    if asyncio.get_running_loop().time() - started < 1.0:  # not a busy loop
                        await asyncio.sleep(self.cfg.retry_s)
                    continue
                except Gone:
                    log.info("discovery (%s): resourceVersion %s expired (410); listing again",
                             self.pool, self.resource_version)
                    listed = False
                    await asyncio.sleep(self.cfg.retry_s)  # a short pause: many clients relist at once
                    continue
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError, APIError) as err:
                    self._failed(f"{type(err).__name__}: {err}")
                    log.warning("discovery (%s): %s; %s in %.1f s", self.pool, self.last_error,
                                "watching again" if listed else "listing again", backoff)
                except Exception as err:  # e.g. an object without the fields a slice has: keep going
                    self._failed(f"{type(err).__name__}: {err}")
                    log.exception("discovery (%s): unexpected failure; retrying in %.1f s", self.pool, backoff)
                # a watch that failed resumes from the last resourceVersion seen (no relist)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)

    def _failed(self, why: str) -> None:
        self.errors += 1
        self.last_error = why

    async def _headers(self, access: Access) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if access.token_file:
            try:
                token = await asyncio.to_thread(_read, access.token_file)
            except OSError as err:
                raise APIError(f"cannot read the token file ({err.strerror})") from None
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    async def _list(self, access: Access, path: str) -> None:
        assert self._session is not None
        slices: dict[str, dict[str, Any]] = {}
        params = {"labelSelector": self.cfg.label_selector, "limit": str(_LIST_LIMIT)}
        headers = await self._headers(access)
        timeout = aiohttp.ClientTimeout(total=30)
        while True:
            async with self._session.get(access.url + path, params=params, headers=headers, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status == 410:
                    raise Gone
                if resp.status != 200:
                    raise APIError(f"list answered {resp.status}: {body[:200].decode(errors='replace')}")
            data = orjson.loads(body)
            for item in data.get("items") or []:
                slices[item["metadata"]["name"]] = item
            meta = data.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        self.resource_version = meta.get("resourceVersion")
        self.lists += 1
        self._slices = slices
        self._recompute()
        self.synced.set()

    async def _watch(self, access: Access, path: str) -> None:
        assert self._session is not None
        params = {"labelSelector": self.cfg.label_selector, "watch": "1", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.cfg.watch_timeout_s)}
        if self.resource_version:
            params["resourceVersion"] = self.resource_version
        headers = await self._headers(access)
        # No total timeout: a watch is long-lived. A silent connection still ends (bookmarks come
        # about once a minute; the server closes the watch after timeoutSeconds).
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.cfg.watch_timeout_s + 60)
        async with self._session.get(access.url + path, params=params, headers=headers, timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone
            if resp.status != 200:
                body = await resp.read()
                raise APIError(f"watch answered {resp.status}: {body[:200].decode(errors='replace')}")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(orjson.loads(line))
            if buf.strip():
                self._event(orjson.loads(buf))

    def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone
            raise APIError(f"watch error event: {obj.get('code')} {obj.get('message', '')}")
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = obj
        elif kind == "DELETED":
            self._slices.pop(meta.get("name"), None)
        else:  # BOOKMARK: only the resourceVersion moves
            return
        self._recompute()

    def _recompute(self) -> None:
        endpoints = ready_endpoints(self._slices, self.cfg)
        if endpoints != self.endpoints:
            added = {e.url for e in endpoints} - {e.url for e in self.endpoints}
            gone = {e.url for e in self.endpoints} - {e.url for e in endpoints}
            self.endpoints = endpoints
            log.info("discovery (%s): %d endpoint(s)%s%s", self.pool, len(endpoints),
                     f", added {sorted(added)}" if added else "", f", removed {sorted(gone)}" if gone else "")
            self._on_change()


class Discovery:
    """The watchers of every pool with a discovery section, and the endpoints they found.

    ``on_change`` is awaited (one call at a time, coalesced) after any pool's set changes and after
    ``configure``; it should apply ``effective(config in force)`` to the pools."""

    def __init__(self, on_change: Callable[[], Awaitable[None]]) -> None:
        self._on_change = on_change
        self.watchers: dict[str, SliceWatcher] = {}
        self._dirty = asyncio.Event()  # a change waits to be applied
        self._idle = asyncio.Event()  # every change seen so far is applied
        self._idle.set()
        self._worker: asyncio.Task | None = None

    def effective(self, cfg: GatewayConfig) -> GatewayConfig:
        """``cfg`` with each pool's endpoints = its static list + what discovery found (a URL
        listed statically keeps its static settings)."""
        update = {}
        for name in POOLS:
            watcher = self.watchers.get(name)
            pool = getattr(cfg.pools, name)
            if watcher is None or pool.discovery is None:
                continue
            static = {e.url for e in pool.endpoints}
            extra = [e for e in watcher.endpoints if e.url not in static]
            if extra:
                update[name] = pool.model_copy(update={"endpoints": [*pool.endpoints, *extra]})
        if not update:
            return cfg
        return cfg.model_copy(update={"pools": cfg.pools.model_copy(update=update)})

    async def configure(self, cfg: GatewayConfig) -> None:
        """Start, restart or stop watchers to match ``cfg``, then have the pools brought up to date."""
        if self._worker is None:
            self._worker = asyncio.create_task(self._work(), name="discovery-apply")
        for name in POOLS:
            want = getattr(cfg.pools, name).discovery
            have = self.watchers.get(name)
            if have is not None and have.cfg == want:
                continue
            carried: tuple[EndpointConfig, ...] = ()
            if have is not None:
                await have.stop()
                del self.watchers[name]
                carried = have.endpoints
            if want is not None:
                # The new watcher starts from the old one's endpoints and keeps them until its first
                # list replaces them: a reload must not empty the pool (a discovery-only decode pool
                # would answer 503, and the prefixes learned for those engines would be forgotten).
                watcher = SliceWatcher(name, want, self._changed, carried)
                self.watchers[name] = watcher
                await watcher.start()
        self._changed()

    def _changed(self) -> None:
        self._idle.clear()
        self._dirty.set()

    async def start(self, cfg: GatewayConfig, wait_s: float = 5.0) -> None:
        """``configure``, then wait up to ``wait_s`` for every watcher's first list (so the pools
        are complete from the first request); a slow or failing API does not stop startup."""
        await self.configure(cfg)
        waits = [w.synced.wait() for w in self.watchers.values()]
        if waits:
            try:
                async with asyncio.timeout(wait_s):
                    await asyncio.gather(*waits)
            except TimeoutError:
                log.warning("discovery: the first list has not completed in %.0f s; serving with the "
                            "static endpoints until it does", wait_s)
            await self.settle()

    async def settle(self) -> None:
        """Return once every change seen so far has been applied."""
        await self._idle.wait()

    async def _work(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._on_change()
            except Exception:  # one bad update must not stop discovery for good (not BaseException)
                log.exception("discovery: applying discovered endpoints failed")
            if not self._dirty.is_set():
                self._idle.set()
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/tasks.py)

    async def close(self) -> None:
        """Stop every watcher and the worker, all at once and within one bound (gateway/tasks.py)."""
        watchers = list(self.watchers.values())
        self.watchers.clear()
        worker, self._worker = self._worker, None
        await asyncio.gather(*(w.stop() for w in watchers), stop_task(worker))
