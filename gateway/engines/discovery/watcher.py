"""One pool's EndpointSlice watcher: list, then watch from the list's resourceVersion, through
kubernetes_asyncio (the package's docstring says what it follows, and how it recovers)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp.http_exceptions import LineTooLong
from kubernetes_asyncio.client import ApiClient, CoreV1Api, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.watch import Watch

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import DiscoveryConfig, EndpointConfig

from .access import AccessError, _access
from .endpoints import node_names, node_topology, ready_endpoints
from .selector import LabelSelector, labels

log = logging.getLogger("gateway.engines.discovery")

_LIST_LIMIT = 500  # slices per list page
_REQUEST_TIMEOUT = 30.0  # a list page or a Node read
# What a failed list or watch raises (an exec plugin that fails: ConfigException); anything else is
# unexpected and logged with its traceback, but retried all the same.
_FAILURES = (ApiException, aiohttp.ClientError, TimeoutError, OSError, ValueError, ConfigException)


class Gone(Exception):
    """410: the resourceVersion is no longer served; list again."""


class APIError(Exception):
    """The API answered something other than what a list or watch expects."""


class EventTooLarge(Exception):
    """A watch event longer than ``max_event_bytes``: the watch ends and the slices are listed again."""


class _Watch(Watch):
    """kubernetes_asyncio's watch, with the events left as the API's JSON (``ready_endpoints`` reads
    a few fields of it; model objects for every slice would only cost CPU) and a bound per event:
    longer than ``limit`` characters raises EventTooLarge. aiohttp splits the stream into lines and
    holds at most twice its read buffer (2 MiB in the library's client) of one line: a longer one
    raises LineTooLong before it is held whole, so that bounds memory whatever ``limit`` says."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def unmarshal_event(self, data: str | bytes, response_type: str | None) -> Any:
        if len(data) > self.limit and len(data.rstrip()) > self.limit:
            raise EventTooLarge(f"a watch event is over {self.limit} bytes (max_event_bytes)")
        return super().unmarshal_event(data, None)


async def _json(resp: object, what: str) -> dict[str, Any]:
    """The JSON body of a response the client left unread (``_preload_content=False``: the API's
    JSON, not model objects; the library's types say the model); 410 raises Gone, another non-200
    APIError."""
    assert isinstance(resp, aiohttp.ClientResponse)
    async with resp:
        body = await resp.read()
    if resp.status == 410:
        raise Gone
    if resp.status != 200:
        raise APIError(f"{what} answered {resp.status}: {body[:200].decode(errors='replace')}")
    data = orjson.loads(body)
    if not isinstance(data, dict):
        raise APIError(f"{what} answered something other than an object")
    return data


class SliceWatcher:
    """Follows the EndpointSlices of one pool; ``on_change()`` runs when its ready set changes."""

    def __init__(
        self, pool: str, cfg: DiscoveryConfig, on_change: Callable[[], None], endpoints: tuple[EndpointConfig, ...] = ()
    ) -> None:
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
        self._selector = LabelSelector.parse(cfg.label_selector)  # valid: the config checked it
        self._task: asyncio.Task[None] | None = None
        self._namespace = ""
        # With node_labels: those labels of each Node an endpoint runs on (Nodes no slice names any
        # more are dropped), the Nodes whose read failed since the last list (not asked again
        # until the next one), and the wake-up of the loop that reads them.
        self._nodes: dict[str, dict[str, str]] = {}
        self._nodes_failed: set[str] = set()
        self._nodes_wanted = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"discovery-{self.pool}")

    async def stop(self) -> None:
        """Bounded (gateway/background.py): a hung API connection or a swallowed cancel cannot hang
        shutdown or a reload."""
        task, self._task = self._task, None
        await stop_task(task)

    # -- the loop -------------------------------------------------------------------------------

    async def _connect(self) -> ApiClient:
        """The API client, once access can be set up (retried with a growing pause until then)."""
        backoff = self.cfg.retry_s
        while True:
            try:
                access = await asyncio.to_thread(_access, self.cfg)
                self._namespace = access.namespace
                # (builds its TLS context here: the CA and client certificate files, once per watcher)
                return ApiClient(access.configuration)
            except (OSError, ValueError) as err:  # e.g. the service account not mounted (SSLError: an OSError)
                where = f"pools.{self.pool}.discovery.{err.field}: " if isinstance(err, AccessError) else ""
                self._failed(f"cannot set up API access: {where}{err}")
                log.error("discovery (%s): %s; retrying in %.1f s", self.pool, self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)

    async def _run(self) -> None:
        async with await self._connect() as client:
            slices, watch = DiscoveryV1Api(client), _Watch(self.cfg.max_event_bytes)
            try:
                if not self.cfg.node_labels:
                    await self._follow(slices, watch)
                    return
                async with asyncio.TaskGroup() as tasks:  # both end when the watcher is stopped
                    tasks.create_task(self._read_nodes(CoreV1Api(client)), name=f"discovery-{self.pool}-nodes")
                    await self._follow(slices, watch)
            finally:
                await watch.close()

    async def _follow(self, api: DiscoveryV1Api, watch: _Watch) -> None:
        """List, then watch, the pool's slices, for as long as the watcher runs."""
        backoff = self.cfg.retry_s
        listed = False  # False: the next step is a full list (at the start and after a 410)
        while True:
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)
            try:
                if not listed:
                    await self._list(api)
                    listed = True
                    backoff = self.cfg.retry_s
                started = asyncio.get_running_loop().time()
                await self._watch(api, watch)  # returns when the server ends the watch
                backoff = self.cfg.retry_s
                if asyncio.get_running_loop().time() - started < 1.0:  # not a busy loop
                    await asyncio.sleep(self.cfg.retry_s)
                continue
            except Gone:
                log.info(
                    "discovery (%s): resourceVersion %s expired (410); listing again", self.pool, self.resource_version
                )
                listed = False
                await asyncio.sleep(self.cfg.retry_s)  # a short pause: many clients relist at once
                continue
            except EventTooLarge as err:
                # Re-watching from the same resourceVersion would meet the same event again: a
                # list reads the state it led to, and the next watch starts after it.
                self._failed(f"EventTooLarge: {err}")
                log.error("discovery (%s): %s; listing again in %.1f s", self.pool, err, backoff)
                listed = False
            except (*_FAILURES, APIError) as err:
                self._failed(f"{type(err).__name__}: {str(err).strip()}")
                log.warning(
                    "discovery (%s): %s; %s in %.1f s",
                    self.pool,
                    self.last_error,
                    "watching again" if listed else "listing again",
                    backoff,
                )
            except Exception as err:  # e.g. an object without the fields a slice has: keep going
                self._failed(f"{type(err).__name__}: {err}")
                log.exception("discovery (%s): unexpected failure; retrying in %.1f s", self.pool, backoff)
            # a watch that failed resumes from the last resourceVersion seen (no relist), unless
            # it was too large an event
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.max_retry_s)

    async def _list(self, api: DiscoveryV1Api) -> None:
        slices: dict[str, dict[str, Any]] = {}
        page: dict[str, Any] = {"label_selector": self.cfg.label_selector, "limit": _LIST_LIMIT}
        while True:
            resp = await api.list_namespaced_endpoint_slice(
                self._namespace, _preload_content=False, _request_timeout=_REQUEST_TIMEOUT, **page
            )
            data = await _json(resp, "list")
            for item in data.get("items") or []:
                if self._selector.matches(labels(item)):  # the server filters; a proxy might not
                    slices[item["metadata"]["name"]] = item
            meta = data.get("metadata") or {}
            if not meta.get("continue"):
                break
            page["_continue"] = meta["continue"]
        self.resource_version = meta.get("resourceVersion")
        self.lists += 1
        self._slices = slices
        self._nodes_failed.clear()
        self._recompute()
        self.synced.set()

    async def _watch(self, api: DiscoveryV1Api, watch: _Watch) -> None:
        """One watch, from the last resourceVersion seen, until the server ends it (after
        ``watch_timeout_s``). With ``timeout_seconds`` the library's watch neither reconnects nor
        retries a 410 itself: both are decided here. An HTTP error and an ERROR event both come as
        ApiException (410 Gone either way)."""
        # No total timeout: a watch is long-lived. A silent connection still ends (bookmarks come
        # about once a minute; the server closes the watch after timeoutSeconds).
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.cfg.watch_timeout_s + 60)
        stream = watch.stream(
            api.list_namespaced_endpoint_slice,
            self._namespace,
            label_selector=self.cfg.label_selector,
            allow_watch_bookmarks=True,
            timeout_seconds=self.cfg.watch_timeout_s,
            resource_version=self.resource_version,
            _request_timeout=timeout,
        )
        try:
            async for event in stream:
                self._event(event, watch.resource_version)
        except ApiException as err:
            if err.status == 410:
                raise Gone from None
            raise APIError(f"watch answered {err.status}: {err.reason}") from None
        except LineTooLong as err:  # over the client's own bound, before max_event_bytes could say
            raise EventTooLarge(f"a watch event is over {err.args[1]} bytes (the client's line limit)") from None

    def _event(self, event: Any, resource_version: str | None) -> None:
        if not isinstance(event, dict):  # a line that is no JSON (the library passes it on)
            raise APIError(f"not a watch event: {str(event)[:200]!r}")
        kind, obj = event["type"], event["raw_object"]
        self.resource_version = resource_version or self.resource_version  # the library's, bookmarks included
        name = (obj.get("metadata") or {}).get("name", "")
        if kind in ("ADDED", "MODIFIED") and self._selector.matches(labels(obj)):
            self._slices[name] = obj
        elif kind in ("ADDED", "MODIFIED", "DELETED"):  # gone, or its labels no longer match
            self._slices.pop(name, None)  # (no Kubernetes object is named "")
        else:  # BOOKMARK: only the resourceVersion moves
            return
        self._recompute()

    # -- Nodes ------------------------------------------------------------------------------------

    async def _read_nodes(self, api: CoreV1Api) -> None:
        """Reads ``node_labels`` of each Node the endpoints run on, once per Node: a Node's topology
        labels (its zone, its EC2 network spine) do not change while it lives. A Node that cannot be
        read (no RBAC for nodes, an API error) is asked again after the next full list."""
        while True:
            await self._nodes_wanted.wait()
            self._nodes_wanted.clear()
            for name in sorted(node_names(self._slices) - self._nodes.keys() - self._nodes_failed):
                try:
                    resp = await api.read_node(name, _preload_content=False, _request_timeout=_REQUEST_TIMEOUT)
                    self._nodes[name] = node_topology(await _json(resp, "node read"), self.cfg.node_labels)
                except Exception as err:  # an API error, or a body that is no Node: never the slices' watch
                    self._nodes_failed.add(name)
                    self._failed(f"cannot read node {name}: {type(err).__name__}: {err}")
                    log.warning(
                        "discovery (%s): %s (the gateway needs get on nodes for node_labels); its "
                        "endpoints have no %s until the next list",
                        self.pool,
                        self.last_error,
                        ", ".join(self.cfg.node_labels),
                    )
                cancel_checkpoint()
            self._recompute()

    def _failed(self, why: str) -> None:
        self.errors += 1
        self.last_error = why

    def _recompute(self) -> None:
        if self.cfg.node_labels:
            names = node_names(self._slices)
            for gone_node in self._nodes.keys() - names:
                del self._nodes[gone_node]
            if names - self._nodes.keys() - self._nodes_failed:
                self._nodes_wanted.set()
        endpoints = ready_endpoints(self._slices, self.cfg, self._nodes)
        if endpoints != self.endpoints:
            added = {e.url for e in endpoints} - {e.url for e in self.endpoints}
            gone = {e.url for e in self.endpoints} - {e.url for e in endpoints}
            self.endpoints = endpoints
            log.info(
                "discovery (%s): %d endpoint(s)%s%s",
                self.pool,
                len(endpoints),
                f", added {sorted(added)}" if added else "",
                f", removed {sorted(gone)}" if gone else "",
            )
            self._on_change()
