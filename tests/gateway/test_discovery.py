"""Engine discovery (gateway/engines/discovery/, on kubernetes_asyncio) against a fake Kubernetes API server
on loopback.

The fake serves real EndpointSlice JSON (discovery.k8s.io/v1) on the API's own paths and streams
watch events (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR 410) from the resourceVersion a client asks
for; an expired resourceVersion gets HTTP 410 Gone, as from a real API server after compaction.
Lists are paginated (``limit`` and ``continue``, one consistent snapshot across the pages) when
``page_size`` is set. With ``filter_selector`` (the default) it applies the label selector as the
API server's watch cache does: a slice whose labels stop matching is sent as DELETED (its previous
state), one that starts matching as ADDED. Without it, it sends every slice it has, as a server or
proxy that ignores ``labelSelector`` would: then only the client's own check keeps other slices out.
It serves https (``ssl=``) and can require a client certificate, for kubeconfig and in-cluster access.
Query values and headers are read as the API server reads them: booleans in any case
(``watch=True``), header names case-insensitively."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl as ssl_
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from starlette.testclient import TestClient

from gateway.config import ConfigError, DiscoveryConfig, GatewayConfig, parse_config
from gateway.engines.discovery import Discovery, SliceWatcher, ready_endpoints
from gateway.engines.pools import Pools
from gateway.http.app import create_app
from gateway.ops.metrics import GatewayMetrics
from tests.procs import free_port
from tests.promtext import sample
from tests.waiting import until, wait_for

from .scripted_engine import ScriptedEngine

NS = "llm"
SELECTOR = "app.kubernetes.io/name=pdgate,app.kubernetes.io/component=decode"
LABELS = {
    "app.kubernetes.io/name": "pdgate",
    "app.kubernetes.io/component": "decode",
    "kubernetes.io/service-name": "pdgate-decode",
    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
}


def endpoint(
    address: str,
    ready: bool | None = True,
    terminating: bool = False,
    pod: str = "",
    zone: str = "us-east-1a",
    node: str = "ip-10-0-1-5.ec2.internal",
) -> dict:
    conditions: dict[str, Any] = {"serving": ready is not False, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [address],
        "conditions": conditions,
        "nodeName": node,
        "zone": zone,
        "targetRef": {
            "kind": "Pod",
            "namespace": NS,
            "name": pod or f"decode-{address}",
            "uid": "0b7a4c1e-0000-4000-8000-000000000000",
        },
    }


def endpoint_slice(
    name: str,
    endpoints: list[dict],
    port: int = 8000,
    address_type: str = "IPv4",
    labels: dict | None = None,
    port_name: str = "http",
) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "generateName": "pdgate-decode-",
            "labels": dict(LABELS if labels is None else labels),
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": "pdgate-decode",
                    "uid": "5d1f0f4e-0000-4000-8000-000000000000",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP", "appProtocol": "http"}],
    }


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeAPI:
    """A Kubernetes API server's EndpointSlice list and watch, on its own thread and loop."""

    def __init__(self, ssl: ssl_.SSLContext | None = None) -> None:
        self.port = free_port()
        self._ssl = ssl
        self.url = f"{'https' if ssl else 'http'}://127.0.0.1:{self.port}"
        self.filter_selector = True  # False: every slice is listed and watched, whatever the selector
        self.requests: list[dict[str, Any]] = []  # {"watch", "params", "headers" (case-insensitive)}
        self.fail_lists = 0  # answer the next lists with 500
        self.fail_watches = 0  # answer the next watches with 500
        self.streaming = 0  # watch streams open now
        self.page_size: int | None = None  # items per list page (None: the client's limit)
        self._pages: dict[str, tuple[str, list[dict]]] = {}  # continue token -> (rv, items left)
        self._slices: dict[str, dict] = {}
        self._rv = 100
        self._oldest = 0  # resourceVersions below this are compacted: 410
        self._history: list[tuple[int, dict, dict | None]] = []  # (rv, event, the object before it)
        self._cond: asyncio.Condition | None = None
        self._cut = 0  # bumping it ends every open watch stream
        self._cut_events: dict[int, dict] = {}  # cut value -> the event its streams end with
        self.nodes: dict[str, dict[str, str]] = {}  # Node name -> its labels (GET /api/v1/nodes/NAME)
        self.nodes_forbidden = False  # answer Node reads with 403, as without RBAC for nodes
        self.node_reads: list[str] = []

    # -- test-side controls (thread-safe) ---------------------------------------------------------

    def _call(self, fn, *args) -> Any:
        async def run():
            async with self._cond:
                out = fn(*args)
                self._cond.notify_all()
                return out

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def put(self, slice_: dict, *, silent: bool = False) -> None:
        """Create or update a slice; ``silent``: no watch event (as if compacted away)."""
        self._call(self._put, slice_, silent)

    def delete(self, name: str) -> None:
        self._call(self._delete, name)

    def expire(self, *, event: bool) -> None:
        """Compact history: every resourceVersion so far is too old. ``event``: open watches get an
        ERROR 410 event; else they are closed (and the client's re-watch gets HTTP 410)."""
        self._call(self._expire, event)

    def bookmark(self) -> str:
        """A BOOKMARK event: only the resourceVersion moves."""
        return self._call(self._bookmark)

    def cut(self) -> None:
        """Drop every open watch connection (the client should reconnect)."""
        self._call(self._bump_cut)

    def fail_open_watches(self, code: int, message: str) -> None:
        """Open watch streams end with an ERROR event carrying this status (not kept in history)."""
        self._call(
            self._fail_open,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": "InternalError",
                "code": code,
            },
        )

    def watches(self) -> list[dict]:
        return [r for r in self.requests if r["watch"]]

    def lists(self) -> list[dict]:
        return [r for r in self.requests if not r["watch"]]

    # -- state, on the server loop ------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _put(self, slice_: dict, silent: bool) -> None:
        obj = orjson.loads(orjson.dumps(slice_))
        name = obj["metadata"]["name"]
        prev = self._slices.get(name)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._slices[name] = obj
        if not silent:
            self._history.append((self._rv, {"type": "MODIFIED" if prev else "ADDED", "object": obj}, prev))

    def _delete(self, name: str) -> None:
        obj = self._slices.pop(name)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._history.append((self._rv, {"type": "DELETED", "object": obj}, obj))

    def _expire(self, event: bool) -> None:
        self._oldest = self._rv + 1
        self._history.clear()
        if event:
            status = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 101 (250)",
                "reason": "Expired",
                "code": 410,
            }
            # reaches the watches open now, not one started from a list made after this
            self._history.append((self._rv, {"type": "ERROR", "object": status}, None))
        else:
            self._cut += 1

    def _bookmark(self) -> str:
        rv = self._next_rv()
        obj = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "metadata": {"resourceVersion": rv}}
        self._history.append((self._rv, {"type": "BOOKMARK", "object": obj}, None))
        return rv

    def _bump_cut(self) -> None:
        self._cut += 1

    def _fail_open(self, status: dict) -> None:
        self._cut_events[self._cut] = {"type": "ERROR", "object": status}
        self._cut += 1

    def _visible(self, ev: dict, prev: dict | None, selector: str) -> dict | None:
        """The event as a watch with ``selector`` gets it (None: not at all), as the API server's
        watch cache converts it: by whether the object matched before and matches after."""
        if not self.filter_selector or ev["type"] in ("ERROR", "BOOKMARK"):
            return ev
        before = prev is not None and _matches(selector, prev["metadata"]["labels"])
        after = ev["type"] != "DELETED" and _matches(selector, ev["object"]["metadata"]["labels"])
        if after:
            return {"type": "MODIFIED" if before else "ADDED", "object": ev["object"]}
        if before:  # left the selection: its previous state, at the event's resourceVersion
            old = orjson.loads(orjson.dumps(prev))
            old["metadata"]["resourceVersion"] = ev["object"]["metadata"]["resourceVersion"]
            return {"type": "DELETED", "object": old}
        return None

    # -- HTTP ---------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert request.match_info["ns"] == NS
        q = request.query
        watch = q.get("watch", "").lower() in ("1", "true")
        self.requests.append({"watch": watch, "params": dict(q), "headers": request.headers.copy()})
        selector = q.get("labelSelector", "")
        if not watch:
            if self.fail_lists:
                self.fail_lists -= 1
                return web.json_response({"kind": "Status", "code": 500, "message": "etcd unavailable"}, status=500)
            if "continue" in q:  # the next page of the snapshot the first page started
                rv, items = self._pages.pop(q["continue"])
            else:
                rv = str(self._rv)
                items = [
                    s
                    for s in self._slices.values()
                    if not self.filter_selector or _matches(selector, s["metadata"]["labels"])
                ]
            size = min(int(q.get("limit") or len(items) or 1), self.page_size or len(items) or 1)
            page, rest = items[:size], items[size:]
            meta: dict[str, Any] = {"resourceVersion": rv}
            if rest:
                token = f"page-{len(self.requests)}"
                self._pages[token] = (rv, rest)
                meta["continue"] = token
                meta["remainingItemCount"] = len(rest)
            return web.json_response(
                {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": meta, "items": page}
            )
        if self.fail_watches:
            self.fail_watches -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd leader changed"}, status=500)
        since = int(q.get("resourceVersion") or self._rv)
        if since < self._oldest - 1:
            return web.json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f"too old resource version: {since}",
                    "reason": "Expired",
                    "code": 410,
                },
                status=410,
            )
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        cut = self._cut
        self.streaming += 1
        try:
            deadline = time.monotonic() + float(q.get("timeoutSeconds", "300"))
            sent = since
            async with self._cond:
                while self._cut == cut and time.monotonic() < deadline:
                    for rv, ev, prev in self._history:
                        if rv > sent:
                            if (seen := self._visible(ev, prev, selector)) is not None:
                                await resp.write(orjson.dumps(seen) + b"\n")
                            sent = rv
                    try:
                        await asyncio.wait_for(self._cond.wait(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        break
        finally:
            self.streaming -= 1
        with contextlib.suppress(ConnectionError):  # the client left first
            if cut in self._cut_events:
                await resp.write(orjson.dumps(self._cut_events[cut]) + b"\n")
            await resp.write_eof()
        return resp

    async def _node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.node_reads.append(name)
        if self.nodes_forbidden:
            return web.json_response(
                {
                    "kind": "Status",
                    "code": 403,
                    "reason": "Forbidden",
                    "message": f'nodes "{name}" is forbidden: User "system:serviceaccount:llm:'
                    'pdgate-gateway" cannot get resource "nodes"',
                },
                status=403,
            )
        if name not in self.nodes:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return web.json_response(
            {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": self.nodes[name]}, "spec": {}}
        )

    def start(self) -> FakeKubeAPI:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._cond = asyncio.Condition()
            app = web.Application()
            app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._handle)
            app.router.add_get("/api/v1/nodes/{name}", self._node)
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._ssl).start()
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        self.cut()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def api():
    server = FakeKubeAPI().start()
    yield server
    server.stop()


def discovery_cfg(api: FakeKubeAPI, token_file: Path | None = None, **kw) -> DiscoveryConfig:
    return DiscoveryConfig(
        label_selector=SELECTOR,
        namespace=NS,
        api_url=api.url,
        token_file=str(token_file) if token_file else None,
        ca_file=None,
        retry_s=0.05,
        max_retry_s=0.2,
        **kw,
    )


def urls(watcher: SliceWatcher) -> list[str]:
    return [e.url for e in watcher.endpoints]


@pytest.mark.parametrize("filter_selector", [True, False], ids=["server-filters", "server-sends-all"])
async def test_list_then_watch_follows_added_modified_deleted(api, tmp_path, filter_selector):
    """Other slices (another selector) never count: a real API server leaves them out, and the
    watcher checks the selector itself, so a server that sends everything changes nothing."""
    api.filter_selector = filter_selector
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    api.put(
        endpoint_slice(
            "pdgate-decode-a",
            [
                endpoint("10.0.0.1"),
                endpoint("10.0.0.2", ready=False),
                endpoint("10.0.0.3", ready=False, terminating=True),
                endpoint("10.0.0.4", ready=None),
            ],
        )
    )
    api.put(endpoint_slice("other-x", [endpoint("10.9.9.9")], labels={"app.kubernetes.io/name": "other"}))
    changes = []
    watcher = SliceWatcher("decode", discovery_cfg(api, token, port="http"), lambda: changes.append(1))
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        # ready and "ready unset" (read as ready) count; not ready and terminating do not
        assert urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]
        [listed] = api.lists()
        assert listed["params"]["labelSelector"] == SELECTOR
        assert listed["headers"]["Authorization"] == "Bearer tok-1"
        await until(lambda: api.watches())
        watch = api.watches()[0]["params"]
        assert watch["resourceVersion"] == watcher.resource_version == "102"
        assert watch["allowWatchBookmarks"].lower() == "true"

        api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.5")]))  # ADDED
        await until(lambda: "http://10.0.0.5:8000" in urls(watcher))
        api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))  # MODIFIED
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.5:8000"])
        api.delete("pdgate-decode-b")  # DELETED
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        api.put(endpoint_slice("other-y", [endpoint("10.9.9.8")], labels={"app.kubernetes.io/name": "other"}))
        rv = api.bookmark()  # after the slice in the stream: once the watcher is there, it has seen the slice
        await until(lambda: watcher.resource_version == rv)  # a re-watch would resume from there
        assert urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]  # a slice it does not match
        assert len(api.lists()) == 1 and watcher.errors == 0
        assert len(changes) == 4  # the first list, then one per change of the ready set
    finally:
        await watcher.stop()


async def test_410_gone_relists_from_an_event_and_from_the_status(api):
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    watcher = SliceWatcher("decode", discovery_cfg(api), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.watches())
        # changes the watch never reports (compacted away), then an ERROR 410 event
        api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.7")]), silent=True)
        api.expire(event=True)
        await until(lambda: urls(watcher) == ["http://10.0.0.7:8000"])
        assert watcher.lists == 2
        # the same, but the watch just ends and the re-watch from the old version gets HTTP 410
        api.put(endpoint_slice("pdgate-decode-c", [endpoint("10.0.0.8")]), silent=True)
        api.expire(event=False)
        await until(lambda: urls(watcher) == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"])
        assert watcher.lists == 3
        # and it keeps watching after a relist
        api.delete("pdgate-decode-c")
        await until(lambda: urls(watcher) == ["http://10.0.0.7:8000"])
    finally:
        await watcher.stop()


async def test_reconnects_after_errors_and_rereads_the_token(api, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-1")
    api.fail_lists = 2
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    watcher = SliceWatcher("decode", discovery_cfg(api, token), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        assert watcher.errors == 2 and "500" in watcher.last_error
        assert urls(watcher) == ["http://10.0.0.1:8000"]
        # An operator sees it in /metrics: synced, what it found, and the failures on the way.
        text = GatewayMetrics(Pools([], []), watchers=lambda: [watcher]).render().decode()
        assert sample(text, "pdgate_discovery_synced", pool="decode") == 1
        assert sample(text, "pdgate_discovery_endpoints", pool="decode") == 1
        assert sample(text, "pdgate_discovery_lists_total", pool="decode") == 1
        assert sample(text, "pdgate_discovery_errors_total", pool="decode") == 2
        await until(lambda: api.watches())
        token.write_text("tok-2")  # rotated
        api.cut()  # the connection drops: the watcher comes back (with the new token)
        await until(lambda: len(api.watches()) >= 2)
        assert api.watches()[-1]["headers"]["Authorization"] == "Bearer tok-2"
        api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")]))
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    finally:
        await watcher.stop()


async def test_paginated_list_is_read_to_the_end(api):
    api.page_size = 2
    for i in range(5):
        api.put(endpoint_slice(f"pdgate-decode-{i}", [endpoint(f"10.0.1.{i}")]))
    api.put(endpoint_slice("other-x", [endpoint("10.9.9.9")], labels={"app.kubernetes.io/name": "other"}))
    watcher = SliceWatcher("decode", discovery_cfg(api), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        assert urls(watcher) == [f"http://10.0.1.{i}:8000" for i in range(5)]
        pages = api.lists()
        assert len(pages) == 3 and watcher.lists == 1
        assert "continue" not in pages[0]["params"]
        assert [p["params"].get("continue") for p in pages[1:]] == ["page-1", "page-2"]  # the tokens the pages gave
        assert all(p["params"]["labelSelector"] == SELECTOR for p in pages)
        # the watch starts from the snapshot's resourceVersion (that of the first page)
        await until(lambda: api.watches())
        assert api.watches()[0]["params"]["resourceVersion"] == watcher.resource_version == "106"
    finally:
        await watcher.stop()


async def test_a_failed_watch_resumes_from_the_last_version_without_relisting(api):
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    watcher = SliceWatcher("decode", discovery_cfg(api), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.watches())
        api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")]))
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        seen = watcher.resource_version
        # the next two watches are refused (500), then the open one drops
        api.fail_watches = 2
        api.cut()
        await until(lambda: len(api.watches()) >= 4)
        assert watcher.errors == 2 and "500" in watcher.last_error
        assert [w["params"]["resourceVersion"] for w in api.watches()[1:4]] == [seen] * 3
        # an ERROR event other than 410 also resumes from the last version
        await until(lambda: api.streaming == 1)  # the 4th watch is streaming
        api.fail_open_watches(500, "internal error")
        await until(lambda: watcher.errors == 3)
        assert "internal error" in watcher.last_error
        await until(lambda: len(api.watches()) >= 5)
        assert api.watches()[-1]["params"]["resourceVersion"] == seen
        api.put(endpoint_slice("pdgate-decode-c", [endpoint("10.0.0.3")]))
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        assert len(api.lists()) == 1 and watcher.lists == 1  # never listed again
    finally:
        await watcher.stop()


def test_dual_stack_service_counts_each_pod_once():
    """A dual-stack Service gets one IPv4 and one IPv6 slice over the same pods."""
    pods = [("10.0.0.1", "fd00::1", "decode-0"), ("10.0.0.2", "fd00::2", "decode-1")]
    slices = {
        "v4": endpoint_slice("v4", [endpoint(v4, pod=pod) for v4, _, pod in pods]),
        "v6": endpoint_slice("v6", [endpoint(v6, pod=pod) for _, v6, pod in pods], address_type="IPv6"),
        "fqdn": endpoint_slice("fqdn", [endpoint("decode.example.com")], address_type="FQDN"),
    }
    v4 = ready_endpoints(slices, DiscoveryConfig(label_selector="x=y", kv_events_port=5557))
    assert [(e.url, e.kv_events) for e in v4] == [
        ("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        ("http://10.0.0.2:8000", "tcp://10.0.0.2:5557"),
    ]
    v6 = ready_endpoints(slices, DiscoveryConfig(label_selector="x=y", address_type="IPv6", kv_events_port=5557))
    assert [(e.url, e.kv_events) for e in v6] == [
        ("http://[fd00::1]:8000", "tcp://[fd00::1]:5557"),
        ("http://[fd00::2]:8000", "tcp://[fd00::2]:5557"),
    ]
    with pytest.raises(ValueError, match="address_type"):
        DiscoveryConfig(label_selector="x=y", address_type="FQDN")


async def test_a_reload_that_changes_discovery_keeps_the_engines_until_the_new_list(api):
    """A changed discovery section replaces the pool's watcher; the pool must not drop its engines
    while the new watcher has not listed (here: its lists fail for a while)."""
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    seen: list[list[str]] = []  # the pool's endpoints at each change the app applies
    cfgs: list[GatewayConfig] = []

    async def applied() -> None:
        seen.append(discovery.effective(cfgs[-1]).pools.decode.urls)

    def gateway_cfg(**kw) -> GatewayConfig:
        d = discovery_cfg(api, **kw).model_dump()
        return parse_config(
            {
                "models": [{"name": "tiny", "tokenizer": "unused", "max_model_len": 64}],
                "pools": {"decode": {"discovery": d}},
            }
        )

    discovery = Discovery(applied)
    cfgs.append(gateway_cfg())
    try:
        await discovery.start(cfgs[-1], wait_s=10)
        assert seen[-1] == ["http://10.0.0.1:8000"]
        seen.clear()
        old = discovery.watchers["decode"]
        api.fail_lists = 10**6  # the new watcher cannot list until told otherwise
        cfgs.append(gateway_cfg(kv_events_port=5557))  # a changed discovery section: a new watcher
        await discovery.configure(cfgs[-1])
        new = discovery.watchers["decode"]
        assert new is not old and not new.synced.is_set()
        await until(lambda: new.errors >= 2)
        await discovery.settle()
        assert seen and all(s == ["http://10.0.0.1:8000"] for s in seen)  # never emptied on the way
        # the new watcher lists: its own view replaces the carried one
        api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.2")]), silent=True)
        api.fail_lists = 0
        await asyncio.wait_for(new.synced.wait(), 10)
        await discovery.settle()
        assert seen[-1] == ["http://10.0.0.2:8000"]
        assert discovery.effective(cfgs[-1]).pools.decode.endpoints[0].kv_events == "tcp://10.0.0.2:5557"
        # a pool whose discovery section is gone drops what discovery found
        cfgs.append(
            parse_config(
                {
                    "models": [{"name": "tiny", "tokenizer": "unused", "max_model_len": 64}],
                    "pools": {"decode": {"endpoints": ["http://10.0.0.9:8000"]}},
                }
            )
        )
        await discovery.configure(cfgs[-1])
        await discovery.settle()
        assert seen[-1] == ["http://10.0.0.9:8000"] and not discovery.watchers
    finally:
        await discovery.close()


def test_ready_endpoints_ports_and_kv_event_addresses():
    slices = {
        "a": endpoint_slice("a", [endpoint("10.0.0.1"), endpoint("10.0.0.1")], port=8000),
        "b": endpoint_slice("b", [endpoint("10.0.0.2")], port=9000, port_name="metrics"),
    }
    cfg = DiscoveryConfig(label_selector="x=y", port="http", kv_events_port=5557, kv_events_replay_port=5558)
    [ep] = ready_endpoints(slices, cfg)  # slice b has no port named http; duplicates collapse
    assert (ep.url, ep.kv_events, ep.kv_events_replay) == (
        "http://10.0.0.1:8000",
        "tcp://10.0.0.1:5557",
        "tcp://10.0.0.1:5558",
    )
    by_number = ready_endpoints(slices, DiscoveryConfig(label_selector="x=y", port=8100, scheme="https"))
    assert [e.url for e in by_number] == ["https://10.0.0.1:8100", "https://10.0.0.2:8100"]
    first_port = ready_endpoints(slices, DiscoveryConfig(label_selector="x=y"))
    assert [e.url for e in first_port] == ["http://10.0.0.1:8000", "http://10.0.0.2:9000"]


def test_config_decode_may_rely_on_discovery_alone(tokenizer_dir):
    base = {"models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}]}
    cfg = parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": SELECTOR, "port": "8000"}}}})
    assert cfg.pools.decode.endpoints == [] and cfg.pools.decode.discovery.port == 8000
    with pytest.raises(ConfigError, match=r"pools.decode: needs at least one endpoint or discovery"):
        parse_config({**base, "pools": {"decode": {"endpoints": []}}})
    with pytest.raises(ConfigError, match=r"pools.decode.discovery.port: .*not in 1..65535"):
        parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "a=b", "port": 70000}}}})
    with pytest.raises(ConfigError, match=r"pools\.decode\.discovery\.label_selector"):
        parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": ""}}}})
    with pytest.raises(ConfigError, match=r"pools\.decode\.discovery\.labels"):  # unknown keys are errors
        parse_config({**base, "pools": {"decode": {"discovery": {"labels": "a=b"}}}})


def _completion(text: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def test_gateway_routing_set_follows_endpointslices(api, tokenizer_dir, tmp_path):
    """The whole gateway: decode engines only from discovery, next to a static prefill engine; the
    pools, /ready and where requests go follow the slices, and a config reload keeps them."""
    engines = [ScriptedEngine().start() for _ in range(3)]
    prefill, d1, d2 = engines
    try:
        api.put(endpoint_slice("pdgate-decode-1", [endpoint("127.0.0.1")], port=d1.port))
        data = {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {
                "prefill": {"endpoints": [prefill.url]},
                "decode": {
                    "discovery": {
                        "label_selector": SELECTOR,
                        "namespace": NS,
                        "api_url": api.url,
                        "token_file": None,
                        "retry_s": 0.05,
                    }
                },
            },
            "routing": {"decider": {"name": "token_threshold", "threshold": 100000}},
            "health": {"interval_s": 0.1},
        }
        path = tmp_path / "gateway.yaml"
        path.write_bytes(orjson.dumps(data))
        with TestClient(create_app(parse_config(data), config_path=path)) as client:

            def decode_pool() -> dict:
                return client.get("/ready").json()["pools"]["decode"]

            def wait(cond, timeout: float = 10.0) -> None:
                assert wait_for(cond, timeout), f"timed out; /ready: {client.get('/ready').json()}"

            def complete() -> str:
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            # the first list completes before the app serves
            assert decode_pool() == {"healthy": 1, "ejected": 0, "total": 1}
            assert client.get("/ready").json()["discovery"] == {
                "decode": {"synced": True, "endpoints": 1, "errors": 0, "last_error": None}
            }
            assert sample(client.get("/metrics").text, "pdgate_discovery_endpoints", pool="decode") == 1
            assert client.get("/ready").json()["pools"]["prefill"]["total"] == 1
            d1.reply("/v1/completions", _completion("from d1"))
            assert complete() == "from d1"

            # a second engine appears, the first goes not-ready (terminating)
            api.put(endpoint_slice("pdgate-decode-2", [endpoint("127.0.0.1")], port=d2.port))
            wait(lambda: decode_pool()["total"] == 2)
            assert sample(client.get("/metrics").text, "pdgate_discovery_endpoints", pool="decode") == 2
            api.put(
                endpoint_slice("pdgate-decode-1", [endpoint("127.0.0.1", ready=False, terminating=True)], port=d1.port)
            )
            wait(lambda: decode_pool() == {"healthy": 1, "ejected": 0, "total": 1})
            d2.reply("/v1/completions", _completion("from d2"))
            assert complete() == "from d2"

            # a reload (another threshold) keeps the discovered engine
            data["routing"]["decider"]["threshold"] = 50000
            path.write_bytes(orjson.dumps(data))
            wait(lambda: client.get("/metrics").text.count('pdgate_config_reloads_total{result="ok"} 1.0') == 1)
            assert decode_pool() == {"healthy": 1, "ejected": 0, "total": 1}

            # every slice gone: no decode engine, not ready
            api.delete("pdgate-decode-1")
            api.delete("pdgate-decode-2")
            wait(lambda: decode_pool()["total"] == 0)
            assert client.get("/ready").status_code == 503
    finally:
        for e in engines:
            e.stop()


def test_in_cluster_access_from_the_service_account(tmp_path, monkeypatch, certs):
    from gateway.engines.discovery.access import AccessError, _access

    (tmp_path / "namespace").write_text("llm\n")
    cfg = DiscoveryConfig(label_selector="a=b", namespace_file=str(tmp_path / "namespace"), ca_file=certs["ca"])
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(AccessError, match="KUBERNETES_SERVICE_HOST is not set"):
        _access(cfg)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    access = _access(cfg)  # the token file need not exist yet: it is read before each request
    assert (access.configuration.host, access.namespace) == ("https://[fd00::1]:443", "llm")
    assert access.configuration.ssl_ca_cert == certs["ca"]  # the named CA, only
    assert access.token_file.endswith("/serviceaccount/token")
    explicit = _access(
        cfg.model_copy(update={"namespace": "other", "api_url": "http://127.0.0.1:1", "token_file": None})
    )
    assert (explicit.configuration.host, explicit.namespace, explicit.token_file) == (
        "http://127.0.0.1:1",
        "other",
        None,
    )
    assert "BearerToken" not in explicit.configuration.api_key  # no token file: no Authorization header


SA_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


@pytest.mark.skipif(Path(SA_CA).exists(), reason="this machine has a service account mounted")
async def test_in_cluster_without_the_service_accounts_ca_is_an_error(tmp_path, monkeypatch):
    """The default ca_file is the service account's: away from a cluster it need not exist (the
    config validates, an api_url uses the system CAs), but in-cluster it must: no silent fallback."""
    from gateway.engines.discovery.access import AccessError, _access

    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = DiscoveryConfig(label_selector="a=b", namespace="llm", retry_s=0.05, max_retry_s=0.1)
    assert cfg.ca_file == SA_CA  # validated here, away from a cluster
    public = _access(cfg.model_copy(update={"api_url": "https://kube.example.com"}))
    assert public.configuration.ssl_ca_cert is None  # the system's CAs
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(AccessError, match=f"{SA_CA} does not exist .*service account") as err:
        _access(cfg)
    assert err.value.field == "ca_file"
    watcher = SliceWatcher("decode", cfg, lambda: None)
    await watcher.start()
    try:
        await until(lambda: watcher.errors >= 2)  # retried, never connected with other CAs
        assert f"pools.decode.discovery.ca_file: {SA_CA} does not exist" in watcher.last_error
        assert not watcher.synced.is_set()
    finally:
        await watcher.stop()


def test_a_ca_file_named_in_the_config_must_exist(tmp_path, certs):
    base = {"models": [{"name": "tiny", "tokenizer": "unused", "max_model_len": 64}]}

    def config(**discovery) -> GatewayConfig:
        return parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "a=b", **discovery}}}})

    missing = str(tmp_path / "ca.crt")
    with pytest.raises(ConfigError, match=rf"pools\.decode\.discovery\.ca_file: {missing} does not exist"):
        config(ca_file=missing, api_url="https://kube.example.com")
    with pytest.raises(ConfigError, match=r"pools\.decode\.discovery\.ca_file: .* does not exist"):
        config(ca_file=missing)  # whatever the mode
    assert config(ca_file=certs["ca"]).pools.decode.discovery.ca_file == certs["ca"]
    assert config(ca_file=None).pools.decode.discovery.ca_file is None  # no CA file: the system's


# -- label selectors ---------------------------------------------------------------------------------


def test_label_selector_matches_as_the_api_server_does():
    from gateway.engines.discovery import LabelSelector

    labels = {"app": "vllm", "tier": "decode", "example.com/zone": "a"}
    cases = {
        "app=vllm": True,
        "app==vllm": True,
        "app=other": False,
        "app!=other": True,
        "app!=vllm": False,
        "missing!=x": True,
        "tier in (prefill, decode)": True,
        "tier in (prefill)": False,
        "tier notin (prefill,x)": True,
        "missing notin (x)": True,
        "tier notin (decode)": False,
        "app": True,
        "missing": False,
        "!missing": True,
        "! app": False,
        "example.com/zone=a": True,
        "app=vllm,tier in (decode),!gpu": True,
        "app=vllm, tier=prefill": False,
        "app=": False,
    }
    for text, expected in cases.items():
        assert LabelSelector.parse(text).matches(labels) is expected, text
    assert LabelSelector.parse("app=").matches({"app": ""})
    for bad in ("app in (a", "app in ()", "a=b,,c=d", "app=vl vm", "app in (a,)", "=x", "a=b)"):
        with pytest.raises(ValueError, match="label selector"):
            LabelSelector.parse(bad)
    base = {"models": [{"name": "tiny", "tokenizer": "unused", "max_model_len": 64}]}
    with pytest.raises(ConfigError, match=r"pools\.decode\.discovery\.label_selector: label selector"):
        parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "app in (a"}}}})


@pytest.mark.parametrize("filter_selector", [True, False], ids=["server-filters", "server-sends-all"])
async def test_a_slice_relabelled_out_of_the_selector_leaves_the_pool(api, filter_selector):
    """A real API server reports it as DELETED (its previous state); a server that sends every
    slice reports a MODIFIED with labels that no longer match: either way it leaves the pool."""
    api.filter_selector = filter_selector
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")]))
    watcher = SliceWatcher("decode", discovery_cfg(api), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.streaming == 1)
        api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")], labels={"app.kubernetes.io/name": "x"}))
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000"])
        api.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.3")]))  # and back in
        await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"])
        assert watcher.errors == 0 and len(api.lists()) == 1
    finally:
        await watcher.stop()


# -- the watch stream --------------------------------------------------------------------------------


async def test_an_oversized_watch_event_ends_the_watch_and_lists_again(api, caplog):
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    watcher = SliceWatcher("decode", discovery_cfg(api, max_event_bytes=4096), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.streaming == 1)
        many = [endpoint(f"10.0.2.{i}") for i in range(40)]  # ~15 KB of JSON in one event
        api.put(endpoint_slice("pdgate-decode-b", many))
        await until(lambda: watcher.lists == 2)  # the watch ended with an error; a list read the slice
        assert watcher.errors == 1 and "max_event_bytes" in watcher.last_error
        assert any(r.levelname == "ERROR" and "max_event_bytes" in r.getMessage() for r in caplog.records)
        assert len(urls(watcher)) == 41
        # and it watches on, from after that event (the list's resourceVersion)
        await until(lambda: len(api.watches()) == 2)
        assert api.watches()[-1]["params"]["resourceVersion"] == watcher.resource_version == "102"
        api.delete("pdgate-decode-a")
        await until(lambda: len(urls(watcher)) == 40)
        assert watcher.errors == 1
    finally:
        await watcher.stop()


async def test_an_event_over_the_clients_line_limit_ends_the_watch_and_lists_again(api):
    """Whatever max_event_bytes says, the client holds at most 4 MiB of one event (aiohttp's line
    limit in kubernetes_asyncio's client): a longer one is an error and a fresh list, as above."""
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    watcher = SliceWatcher("decode", discovery_cfg(api, max_event_bytes=16 * 2**20), lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.streaming == 1)
        huge = endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")])
        huge["metadata"]["annotations"] = {"example.com/padding": "x" * (5 * 2**20)}
        api.put(huge)
        await until(lambda: watcher.lists == 2)
        assert watcher.errors == 1 and "line limit" in watcher.last_error
        assert urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        await until(lambda: len(api.watches()) == 2)
        api.delete("pdgate-decode-a")
        await until(lambda: urls(watcher) == ["http://10.0.0.2:8000"])
    finally:
        await watcher.stop()


# -- kubeconfig ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed (openssl CLI)."""
    d = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(f"{ext}\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "3650",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    return {"ca": str(d / "ca.crt")} | {
        f"{n}_{kind}": str(d / f"{n}.{kind}") for n in ("server", "client") for kind in ("crt", "key")
    }


def write_kubeconfig(
    path: Path, server: str, user: dict, *, cluster: dict | None = None, namespace: str = NS, context: str = "dev"
) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": context,
                "clusters": [{"name": "c1", "cluster": {"server": server, **(cluster or {})}}],
                "users": [{"name": "u1", "user": user}],
                "contexts": [{"name": "dev", "context": {"cluster": "c1", "user": "u1", "namespace": namespace}}],
            }
        )
    )
    return path


def _b64(path: str) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def test_kubeconfig_access(tmp_path, certs, monkeypatch):
    from gateway.engines.discovery.access import AccessError, _access

    (tmp_path / "token").write_text("from-file\n")
    (tmp_path / "ca.crt").write_bytes(Path(certs["ca"]).read_bytes())
    kc = write_kubeconfig(
        tmp_path / "config",
        "https://kube.example.com:6443/",
        {"token": "static-token", "tokenFile": "token"},
        cluster={"certificate-authority": "ca.crt"},
    )  # relative: next to the kubeconfig
    cfg = DiscoveryConfig(label_selector="a=b", kubeconfig=str(kc))
    access = _access(cfg)
    assert (access.configuration.host, access.namespace) == ("https://kube.example.com:6443", NS)
    assert access.token_file == str(tmp_path / "token")  # tokenFile wins over token, as in client-go
    assert access.configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    # the config's namespace wins; an explicitly named token file too
    (tmp_path / "other-token").write_text("mine")
    mine = _access(cfg.model_copy(update={"namespace": "n2", "token_file": str(tmp_path / "other-token")}))
    assert (mine.namespace, mine.token_file) == ("n2", str(tmp_path / "other-token"))
    inline = write_kubeconfig(
        tmp_path / "inline",
        "https://kube.example.com",
        {"token": "t"},
        cluster={"certificate-authority-data": _b64(certs["ca"])},
        namespace="",
    )
    access = _access(cfg.model_copy(update={"kubeconfig": str(inline)}))
    assert (access.configuration.api_key["BearerToken"], access.token_file, access.namespace) == (
        "Bearer t",
        None,
        "default",
    )
    assert Path(access.configuration.ssl_ca_cert).read_bytes() == Path(certs["ca"]).read_bytes()  # a temporary file
    insecure = write_kubeconfig(
        tmp_path / "insecure", "https://kind.local:6443", {"token": "t"}, cluster={"insecure-skip-tls-verify": True}
    )
    assert _access(cfg.model_copy(update={"kubeconfig": str(insecure)})).configuration.verify_ssl is False

    base = {"models": [{"name": "tiny", "tokenizer": "unused", "max_model_len": 64}]}

    def config(**discovery) -> GatewayConfig:
        return parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "a=b", **discovery}}}})

    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=rf"pools\.decode\.discovery\.kubeconfig: {missing} does not exist"):
        config(kubeconfig=missing)
    with pytest.raises(ConfigError, match=r"pools\.decode\.discovery\.kubeconfig: set api_url or kubeconfig"):
        config(kubeconfig=str(kc), api_url="https://x.example.com")
    eks = {
        "exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws", "args": ["eks", "get-token"]}
    }
    assert config(kubeconfig=str(write_kubeconfig(tmp_path / "eks", "https://x.example.com", eks))).pools.decode
    gcp = write_kubeconfig(tmp_path / "gcp", "https://x.example.com", {"auth-provider": {"name": "gcp"}})
    with pytest.raises(ConfigError, match=r"kubeconfig: .*authenticates with auth-provider, which pdgate does not"):
        config(kubeconfig=str(gcp))
    plugin = write_kubeconfig(tmp_path / "bad-exec", "https://x.example.com", {"exec": {"command": "aws"}})
    with pytest.raises(ConfigError, match=r"kubeconfig: .*exec: malformed request. missing key 'apiVersion'"):
        config(kubeconfig=str(plugin))
    other = write_kubeconfig(tmp_path / "ctx", "https://x.example.com", {"token": "t"}, context="prod")
    with pytest.raises(ConfigError, match=r"kubeconfig: .*not a usable kubeconfig .*name prod in .*contexts"):
        config(kubeconfig=str(other))
    gone = write_kubeconfig(
        tmp_path / "gone", "https://x.example.com", {"token": "t"}, cluster={"certificate-authority": "missing-ca.crt"}
    )
    with pytest.raises(ConfigError, match=r"kubeconfig: .*certificate-authority .*missing-ca.crt does not exist"):
        config(kubeconfig=str(gone))
    for text in ("- just\n- a list\n", "", "clusters: [\n"):
        (tmp_path / "junk").write_text(text)
        with pytest.raises(ConfigError, match=r"kubeconfig: .*junk: not a usable kubeconfig"):
            config(kubeconfig=str(tmp_path / "junk"))
    no_server = write_kubeconfig(tmp_path / "no-server", "", {"token": "t"})
    with pytest.raises(ConfigError, match=r"kubeconfig: .*has no http\(s\) server"):
        config(kubeconfig=str(no_server))
    assert config(kubeconfig=str(kc)).pools.decode.discovery.kubeconfig == str(kc)
    # $KUBECONFIG is the environment's: checked when the watcher starts, not by the config
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", f"{missing}:{gcp}")
    config()
    with pytest.raises(AccessError, match=r"\$KUBECONFIG: .*auth-provider") as err:
        _access(DiscoveryConfig(label_selector="a=b"))
    assert err.value.field == "kubeconfig"


async def test_watcher_with_a_kubeconfig_client_certificate_over_https(certs):
    """Outside the cluster: server, CA and client certificate (inline data) from a kubeconfig,
    against an API that requires the certificate."""
    tls = ssl_.create_default_context(ssl_.Purpose.CLIENT_AUTH, cafile=certs["ca"])
    tls.load_cert_chain(certs["server_crt"], certs["server_key"])
    tls.verify_mode = ssl_.CERT_REQUIRED
    server = FakeKubeAPI(ssl=tls).start()
    try:
        server.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
        kc = write_kubeconfig(
            Path(certs["ca"]).parent / "kubeconfig",
            server.url,
            {"client-certificate-data": _b64(certs["client_crt"]), "client-key-data": _b64(certs["client_key"])},
            cluster={"certificate-authority-data": _b64(certs["ca"])},
        )
        cfg = DiscoveryConfig(label_selector=SELECTOR, kubeconfig=str(kc), retry_s=0.05, max_retry_s=0.2)
        watcher = SliceWatcher("decode", cfg, lambda: None)
        await watcher.start()
        try:
            await asyncio.wait_for(watcher.synced.wait(), 10)
            assert urls(watcher) == ["http://10.0.0.1:8000"] and watcher.errors == 0
            assert "Authorization" not in server.lists()[0]["headers"]
            server.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")]))
            await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        finally:
            await watcher.stop()
    finally:
        server.stop()


async def test_watcher_from_the_kubeconfig_environment_variable(api, tmp_path, monkeypatch):
    """Not in a cluster, no api_url: $KUBECONFIG's files, merged as kubectl merges them."""
    first = tmp_path / "a.yaml"
    first.write_text(
        yaml.safe_dump(
            {
                "current-context": "dev",
                "contexts": [{"name": "dev", "context": {"cluster": "c1", "user": "u1", "namespace": NS}}],
            }
        )
    )
    second = write_kubeconfig(
        tmp_path / "b.yaml", api.url, {"token": "kube-token"}, namespace="ignored", context="other"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", f"{first}:{tmp_path / 'missing.yaml'}:{second}")
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    cfg = DiscoveryConfig(label_selector=SELECTOR, retry_s=0.05, max_retry_s=0.2)
    watcher = SliceWatcher("decode", cfg, lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        assert urls(watcher) == ["http://10.0.0.1:8000"]
        assert api.lists()[0]["headers"]["Authorization"] == "Bearer kube-token"
    finally:
        await watcher.stop()


EXEC_PLUGIN = """\
import datetime, json, os, pathlib, sys
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(n))
expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=int(sys.argv[2]))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])  # what kubectl passes a credential plugin
print(json.dumps({
    "apiVersion": info["apiVersion"],
    "kind": "ExecCredential",
    "status": {"token": f"exec-token-{n}", "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")},
}))
"""


@pytest.mark.parametrize("ttl_s", [3600, 60], ids=["valid-token", "expiring-token"])
async def test_watcher_with_a_kubeconfig_exec_plugin(api, tmp_path, ttl_s):
    """An EKS-style kubeconfig: the user's token comes from a credential plugin (``aws eks
    get-token``), run by the client and sent as a bearer token; a token within 5 minutes of its
    expiry is fetched again before the next request, a valid one is kept."""
    plugin = tmp_path / "get-token"
    plugin.write_text(f"#!{sys.executable}\n{EXEC_PLUGIN}")
    plugin.chmod(0o755)
    runs = tmp_path / "runs"
    exec_ = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "args": [str(runs), str(ttl_s)],
        "interactiveMode": "Never",
    }
    kc = write_kubeconfig(tmp_path / "config", api.url, {"exec": exec_})
    api.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
    cfg = DiscoveryConfig(label_selector=SELECTOR, kubeconfig=str(kc), retry_s=0.05, max_retry_s=0.2)
    watcher = SliceWatcher("decode", cfg, lambda: None)
    await watcher.start()
    try:
        await asyncio.wait_for(watcher.synced.wait(), 10)
        await until(lambda: api.streaming == 1)
        api.cut()  # a second watch: a second request to authenticate
        await until(lambda: len(api.watches()) == 2)
        tokens = [r["headers"]["Authorization"] for r in api.requests]
        assert watcher.errors == 0 and len(tokens) == 3
        if ttl_s == 3600:
            assert tokens == ["Bearer exec-token-1"] * 3 and runs.read_text() == "1"  # run once, at setup
        else:  # run at setup, then before each request
            assert tokens == ["Bearer exec-token-2", "Bearer exec-token-3", "Bearer exec-token-4"]
        assert urls(watcher) == ["http://10.0.0.1:8000"]
    finally:
        await watcher.stop()


async def test_an_exec_plugin_that_fails_is_retried(api, tmp_path):
    plugin = tmp_path / "get-token"
    plugin.write_text(f"#!{sys.executable}\nimport sys; print('no credentials', file=sys.stderr); sys.exit(3)\n")
    plugin.chmod(0o755)
    exec_ = {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin)}
    kc = write_kubeconfig(tmp_path / "config", api.url, {"exec": exec_})
    watcher = SliceWatcher(
        "decode", DiscoveryConfig(label_selector=SELECTOR, kubeconfig=str(kc), retry_s=0.05), lambda: None
    )
    await watcher.start()
    try:
        await until(lambda: watcher.errors >= 2)
        assert "pools.decode.discovery.kubeconfig: exec: process returned 3. no credentials" in watcher.last_error
        assert not api.requests
    finally:
        await watcher.stop()


async def test_in_cluster_watcher_follows_the_rotating_service_account_token(tmp_path, monkeypatch, certs):
    """In a pod: the API from KUBERNETES_SERVICE_HOST/_PORT over https with the service account's CA,
    its namespace, and its projected token, which the kubelet rewrites: re-read for every request."""
    tls = ssl_.create_default_context(ssl_.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs["server_crt"], certs["server_key"])
    server = FakeKubeAPI(ssl=tls).start()
    try:
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        (sa / "token").write_text("sa-token-1")
        (sa / "namespace").write_text(NS)
        monkeypatch.delenv("KUBECONFIG", raising=False)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
        server.put(endpoint_slice("pdgate-decode-a", [endpoint("10.0.0.1")]))
        cfg = DiscoveryConfig(
            label_selector=SELECTOR,
            token_file=str(sa / "token"),
            ca_file=certs["ca"],
            namespace_file=str(sa / "namespace"),
            retry_s=0.05,
            max_retry_s=0.2,
        )
        watcher = SliceWatcher("decode", cfg, lambda: None)
        await watcher.start()
        try:
            await asyncio.wait_for(watcher.synced.wait(), 10)
            assert server.lists()[0]["headers"]["Authorization"] == "Bearer sa-token-1"
            await until(lambda: server.streaming == 1)
            (sa / "token").write_text("sa-token-2")  # rotated
            server.cut()
            await until(lambda: len(server.watches()) >= 2)
            assert server.watches()[-1]["headers"]["Authorization"] == "Bearer sa-token-2"
            server.put(endpoint_slice("pdgate-decode-b", [endpoint("10.0.0.2")]))
            await until(lambda: urls(watcher) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
            (sa / "token").unlink()  # unreadable: an error, retried, until it is back
            server.cut()
            await until(lambda: "cannot read the token file" in watcher.last_error)
            (sa / "token").write_text("sa-token-3")
            await until(lambda: server.watches()[-1]["headers"]["Authorization"] == "Bearer sa-token-3")
        finally:
            await watcher.stop()
    finally:
        server.stop()


# -- topology: zones from the slices, spines from the Nodes ---------------------------------------

ZONE = "topology.kubernetes.io/zone"
SPINE = "topology.k8s.aws/network-node-layer-3"


def test_ready_endpoints_carry_the_slices_zone_and_the_nodes_labels():
    slices = {
        "a": endpoint_slice(
            "a",
            [
                endpoint("10.0.0.1", zone="us-east-1a", node="n1"),
                endpoint("10.0.0.2", zone="us-east-1b", node="n2"),
                endpoint("10.0.0.3", zone="", node=""),
            ],
        )
    }
    cfg = DiscoveryConfig(label_selector="x=y", node_labels=[SPINE])
    eps = ready_endpoints(slices, cfg, {"n1": {SPINE: "nn-1"}})
    assert [e.topology for e in eps] == [{ZONE: "us-east-1a", SPINE: "nn-1"}, {ZONE: "us-east-1b"}, {}]


async def test_node_labels_are_read_once_per_node_and_follow_the_slices(api):
    api.nodes = {"n1": {SPINE: "nn-1", "other": "x"}, "n2": {SPINE: "nn-2"}}
    api.put(
        endpoint_slice(
            "pdgate-decode-1",
            [endpoint("10.0.0.1", node="n1"), endpoint("10.0.0.2", node="n2"), endpoint("10.0.0.3", node="n1")],
        )
    )
    watcher = SliceWatcher("decode", discovery_cfg(api, node_labels=[SPINE]), lambda: None)
    await watcher.start()
    try:
        await until(lambda: all(SPINE in e.topology for e in watcher.endpoints) and len(watcher.endpoints) == 3)
        assert {e.url: e.topology[SPINE] for e in watcher.endpoints} == {
            "http://10.0.0.1:8000": "nn-1",
            "http://10.0.0.2:8000": "nn-2",
            "http://10.0.0.3:8000": "nn-1",
        }
        assert all(e.topology[ZONE] == "us-east-1a" for e in watcher.endpoints)
        assert sorted(api.node_reads) == ["n1", "n2"]  # once per Node, only the labels asked for
        # a new engine on a new Node: that Node is read, the others are not again
        api.nodes["n3"] = {SPINE: "nn-3"}
        api.put(endpoint_slice("pdgate-decode-2", [endpoint("10.0.0.4", node="n3")]))
        await until(lambda: any(e.topology.get(SPINE) == "nn-3" for e in watcher.endpoints))
        assert sorted(api.node_reads) == ["n1", "n2", "n3"]
    finally:
        await watcher.stop()


async def test_without_rbac_for_nodes_the_endpoints_keep_their_zone_and_the_error_shows(api):
    api.nodes_forbidden = True
    api.put(endpoint_slice("pdgate-decode-1", [endpoint("10.0.0.1", node="n1", zone="us-east-1b")]))
    watcher = SliceWatcher("decode", discovery_cfg(api, node_labels=[SPINE]), lambda: None)
    await watcher.start()
    try:
        await until(lambda: watcher.errors > 0)
        assert [e.topology for e in watcher.endpoints] == [{ZONE: "us-east-1b"}]
        assert "cannot read node n1" in watcher.last_error and "403" in watcher.last_error
        api.put(
            endpoint_slice(
                "pdgate-decode-1",
                [
                    endpoint("10.0.0.1", node="n1", zone="us-east-1b"),
                    endpoint("10.0.0.5", node="n1", zone="us-east-1b"),
                ],
            )
        )
        await until(lambda: len(watcher.endpoints) == 2)
        await asyncio.sleep(0.3)
        assert api.node_reads == ["n1"]  # a refused Node is not asked again until the next list
    finally:
        await watcher.stop()


def _prefill_answer(engine: str) -> dict:
    return {
        "id": "cmpl-p",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine,
            "remote_block_ids": [[1]],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        },
    }


def test_gateway_pairs_prefill_and_decode_engines_inside_their_zone(api, tokenizer_dir, tmp_path):
    """The whole gateway with both pools discovered from slices with zones (two per zone): every P/D
    request's KV handle comes from a prefill engine in its decode engine's zone; once zone b has no
    prefill engine left, zone b's requests go direct (reason no_prefill_in_zone) and zone a's keep P/D."""
    engines = {name: ScriptedEngine().start() for name in ("pa", "pb", "da", "db")}
    try:
        for name, eng in engines.items():
            pool = "prefill" if name.startswith("p") else "decode"
            labels = {**LABELS, "app.kubernetes.io/component": pool, "kubernetes.io/service-name": f"pdgate-{pool}"}
            api.put(
                endpoint_slice(
                    f"pdgate-{name}",
                    [endpoint("127.0.0.1", zone=f"us-east-1{name[1]}", pod=name)],
                    port=eng.port,
                    labels=labels,
                )
            )
        disc = {"namespace": NS, "api_url": api.url, "token_file": None, "retry_s": 0.05}
        data = {
            "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 1024}],
            "pools": {
                pool: {"discovery": {**disc, "label_selector": f"kubernetes.io/service-name=pdgate-{pool}"}}
                for pool in ("prefill", "decode")
            },
            "routing": {
                "decider": {"name": "token_threshold", "threshold": 1},
                "prefill": {"filters": [{"name": "same_zone"}]},
            },
            "health": {"interval_s": 0.1},
        }
        path = tmp_path / "gateway.yaml"
        path.write_bytes(orjson.dumps(data))
        with TestClient(create_app(parse_config(data), config_path=path)) as client:
            assert wait_for(lambda: client.get("/ready").json()["pools"]["prefill"]["healthy"] == 2, 10)

            def send(n: int) -> list[str]:
                paths = []
                for _ in range(n):
                    for name in ("pa", "pb"):
                        engines[name].reply("/v1/completions", _prefill_answer(name))
                    for name in ("da", "db"):
                        engines[name].reply("/v1/completions", _completion(name))
                    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    paths.append((r.headers["x-pdgate-path"], r.json()["choices"][0]["text"]))
                    for eng in engines.values():  # unused scripted answers do not carry over
                        eng._queue.clear()
                return paths

            first = send(8)
            pulls = {
                (d, rec.body["kv_transfer_params"]["remote_engine_id"])
                for d in ("da", "db")
                for rec in engines[d].posts("/v1/completions")
            }
            assert {d for _, d in first} == {"da", "db"} and all(p == "pd" for p, _ in first)
            assert pulls == {("da", "pa"), ("db", "pb")}  # never across zones

            api.delete("pdgate-pb")  # zone b has no prefill engine any more
            assert wait_for(lambda: client.get("/ready").json()["pools"]["prefill"]["total"] == 1, 10)
            for eng in engines.values():
                eng.reset()
            second = send(8)
            assert {(p, d) for p, d in second} == {("pd", "da"), ("direct", "db")}
            assert all("kv_transfer_params" not in rec.body for rec in engines["db"].posts("/v1/completions"))
            assert sample(
                client.get("/metrics").text, "pdgate_route_decisions_total", path="direct", reason="no_prefill_in_zone"
            ) == sum(1 for p, _ in second if p == "direct")
    finally:
        for e in engines.values():
            e.stop()


LAZY_CLIENT = """
import sys
from gateway.tokenization import frameworks
frameworks.keep_out()
import gateway.cli, gateway.http.app
from gateway.config import parse_config
from gateway.engines.discovery import Discovery
base = {"models": [{"name": "m", "tokenizer": "t", "max_model_len": 1024}]}
parse_config({**base, "pools": {"decode": {"endpoints": ["http://127.0.0.1:1"]}}})
print(int("kubernetes_asyncio" in sys.modules))
parse_config({**base, "pools": {"decode": {"discovery": {"label_selector": "app=vllm", "port": 8000}}}})
print(int("kubernetes_asyncio" in sys.modules))
"""


def test_the_kubernetes_client_is_loaded_only_with_discovery_configured():
    """kubernetes_asyncio's client (every API model class) holds ~43 MB in each worker: a gateway
    with static endpoints only never imports it; a discovery section does."""
    out = subprocess.run([sys.executable, "-c", LAZY_CLIENT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]
