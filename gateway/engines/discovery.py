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

The API is reached in one of three ways (``_access``): ``api_url`` (with ``token_file`` and
``ca_file``); a kubeconfig (``kubeconfig``, or ``$KUBECONFIG`` when not in a cluster) whose current
context gives the server, the CA, a token or a client certificate, and the namespace; else in-cluster
(``KUBERNETES_SERVICE_HOST`` and the service account's files). A CA file the config names must exist:
config validation refuses it otherwise, and so does the watcher for the service account's CA in
in-cluster mode (no silent fallback to the system CAs, which cannot verify a cluster's own CA).

The API server filters by ``labelSelector``; the watcher checks every slice against the selector
too (``LabelSelector``), so what it follows never depends on a server or proxy honoring it, and a
slice whose labels stop matching leaves the pool (a real server reports that as DELETED). Watch
events are newline-delimited JSON, split in linear time with a bound per event
(``max_event_bytes``): a larger one ends the watch with an error and a fresh list.

Everything runs on the event loop without blocking it: HTTP through aiohttp, the token, CA and
kubeconfig files read on a worker thread (the token again on every connection: projected tokens
rotate).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import re
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import yaml

from gateway.background import cancel_checkpoint, stop_task
from gateway.config import DiscoveryConfig, EndpointConfig, GatewayConfig
from policies.base import ZONE

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
_LIST_LIMIT = 500  # slices per list page


class Gone(Exception):
    """410: the resourceVersion is no longer served; list again."""


class APIError(Exception):
    """The API answered something other than what a list or watch expects."""


class EventTooLarge(Exception):
    """A watch event longer than ``max_event_bytes``: the watch ends and the slices are listed again."""


# -- label selectors ------------------------------------------------------------------------------

_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EQUALITY = re.compile(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})")
_SET = re.compile(rf"({_KEY})\s+(in|notin)\s*\(([^()]*)\)")
_EXISTS = re.compile(rf"(!?)\s*({_KEY})")
_VALUE_RE = re.compile(_VALUE)
LABEL_KEY = re.compile(  # [DNS subdomain prefix/]name, as the API server checks label keys
    r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
LABEL_VALUE = _VALUE_RE


@dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector (``a=b,c!=d,e in (f,g),h notin (i),j,!k``), to check slices
    client-side with the very semantics the API server applies."""

    text: str
    requirements: tuple[tuple[str, str, frozenset[str]], ...]  # (key, op, values)

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Raises ValueError naming the term it cannot read."""
        reqs: list[tuple[str, str, frozenset[str]]] = []
        for term in _terms(text):
            if m := _EQUALITY.fullmatch(term):
                reqs.append((m[1], "!=" if m[2] == "!=" else "=", frozenset((m[3],))))
            elif m := _SET.fullmatch(term):
                values = [v.strip() for v in m[3].split(",")]
                if not all(values) or not all(_VALUE_RE.fullmatch(v) for v in values):
                    raise ValueError(f"label selector {text!r}: bad values in {term!r}")
                reqs.append((m[1], m[2], frozenset(values)))
            elif m := _EXISTS.fullmatch(term):
                reqs.append((m[2], "!" if m[1] else "exists", frozenset()))
            else:
                raise ValueError(f"label selector {text!r}: cannot read {term!r}")
        return cls(text, tuple(reqs))

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, op, values in self.requirements:
            have = labels.get(key)
            if op in ("=", "in"):
                ok = have is not None and have in values
            elif op in ("!=", "notin"):
                ok = have is None or have not in values
            else:
                ok = (have is not None) == (op == "exists")
            if not ok:
                return False
        return True


def _terms(text: str) -> list[str]:
    """The selector's comma-separated terms (commas inside ``in (...)`` belong to the term)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(text[start:i].strip())
            start = i + 1
    terms.append(text[start:].strip())
    if depth or (text.strip() and not all(terms)):
        raise ValueError(f"label selector {text!r}: empty term or unbalanced parentheses")
    return [t for t in terms if t]


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


# -- reaching the API -----------------------------------------------------------------------------


class AccessError(ValueError):
    """API access cannot be set up; ``field`` is the discovery key at fault (for the message's
    location, ``pools.<pool>.discovery.<field>``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Access:
    """How to reach the API server: base URL, TLS context, credentials and namespace. The token
    file (re-read on every connection) wins over a static token, as in client-go."""

    url: str
    ssl: ssl.SSLContext | None
    token_file: str | None
    namespace: str
    token: str | None = None


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8").strip()


def _explicit(cfg: DiscoveryConfig, field: str) -> str | None:
    """The file ``cfg`` names for ``field`` when it is not the service account's default."""
    value = getattr(cfg, field)
    return value if value is not None and value != type(cfg).model_fields[field].default else None


def check_files(cfg: DiscoveryConfig) -> list[tuple[str, str]]:
    """What config validation checks (environment-independent): the files the config itself
    names. ``(field, message)`` per problem. Blocking (reads the kubeconfig)."""
    errors: list[tuple[str, str]] = []
    if cfg.api_url and cfg.kubeconfig:
        errors.append(("kubeconfig", "set api_url or kubeconfig, not both"))
    if (ca := _explicit(cfg, "ca_file")) and not Path(ca).is_file():
        errors.append(("ca_file", f"{ca} does not exist"))
    if cfg.kubeconfig:
        try:
            read_kubeconfig([cfg.kubeconfig])
        except ValueError as err:
            errors.append(("kubeconfig", str(err)))
    return errors


def _in_cluster_url() -> str | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def _access(cfg: DiscoveryConfig) -> Access:
    """Blocking (reads files): call it on a worker thread. Raises AccessError (or OSError for an
    unreadable namespace file). Modes, first match: ``api_url``, ``kubeconfig``, in-cluster,
    ``$KUBECONFIG``."""
    if cfg.kubeconfig is not None and cfg.api_url is None:
        return _kubeconfig_access(cfg, [cfg.kubeconfig], "kubeconfig")
    for field, message in check_files(cfg):  # a file removed since validation
        raise AccessError(field, message)
    if cfg.api_url is not None:
        url = cfg.api_url
        # An explicit API's CA: the one named, else the service account's when mounted, else the
        # system's (e.g. an API behind a public certificate).
        ca = cfg.ca_file if cfg.ca_file and Path(cfg.ca_file).is_file() else None
    elif (in_cluster := _in_cluster_url()) is not None:
        url = in_cluster
        # The service account's CA is the only one that verifies the API: missing means the
        # service account is not mounted (automountServiceAccountToken: false?).
        if cfg.ca_file and not Path(cfg.ca_file).is_file():
            raise AccessError(
                "ca_file",
                f"{cfg.ca_file} does not exist (in-cluster API access needs the service "
                "account's CA: is the service account token mounted?)",
            )
        ca = cfg.ca_file
    else:
        paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        if not paths:
            raise AccessError(
                "api_url",
                "no api_url, KUBERNETES_SERVICE_HOST is not set (not in a pod?) and no "
                "kubeconfig (discovery.kubeconfig or $KUBECONFIG)",
            )
        if not (existing := [p for p in paths if Path(p).expanduser().is_file()]):  # kubectl skips missing ones
            raise AccessError("kubeconfig", f"$KUBECONFIG: none of {', '.join(paths)} exists")
        return _kubeconfig_access(cfg, existing, "kubeconfig")
    ctx = ssl.create_default_context(cafile=ca) if url.startswith("https://") else None
    namespace = cfg.namespace or _read(cfg.namespace_file)
    return Access(url, ctx, cfg.token_file, namespace)


# -- kubeconfig -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kubeconfig:
    """What a kubeconfig's current context says (files resolved against the kubeconfig's folder)."""

    server: str
    namespace: str | None = None
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None
    cert_file: str | None = None
    cert_data: bytes | None = None
    key_file: str | None = None
    key_data: bytes | None = None


_UNSUPPORTED_AUTH = ("exec", "auth-provider", "username", "password")


def read_kubeconfig(paths: Sequence[str]) -> Kubeconfig:  # noqa: C901 - over the limit before it was set; to split
    """The current context of the kubeconfig ``paths`` (merged as kubectl merges ``$KUBECONFIG``:
    the first file to define a name or ``current-context`` wins). Supported: ``server``,
    ``certificate-authority[-data]``, ``insecure-skip-tls-verify``, ``token``, ``tokenFile``,
    ``client-certificate[-data]`` and ``client-key[-data]``; credential plugins (``exec``,
    ``auth-provider``) and basic auth are refused with a ValueError, as is anything missing."""
    merged: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {"clusters": {}, "users": {}, "contexts": {}}
    current: str | None = None
    for path in paths:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"{path} does not exist")
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise ValueError(f"{path}: cannot read it as YAML ({type(err).__name__})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: not a kubeconfig (a mapping)")
        current = current or doc.get("current-context") or None
        for section, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(section) or []:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    merged[section].setdefault(entry["name"], (entry.get(inner) or {}, p.parent))
    where = ", ".join(paths)
    if not current:
        raise ValueError(f"{where}: no current-context")
    if current not in merged["contexts"]:
        raise ValueError(f"{where}: context {current!r} not found")
    context, _ = merged["contexts"][current]
    cluster_name, user_name = context.get("cluster"), context.get("user")
    if cluster_name not in merged["clusters"]:
        raise ValueError(f"{where}: cluster {cluster_name!r} of context {current!r} not found")
    cluster, cluster_dir = merged["clusters"][cluster_name]
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ValueError(f"{where}: cluster {cluster_name!r} has no http(s) server")
    user, user_dir = merged["users"].get(user_name, ({}, cluster_dir)) if user_name else ({}, cluster_dir)
    if user_name and user_name not in merged["users"]:
        raise ValueError(f"{where}: user {user_name!r} of context {current!r} not found")
    if bad := [k for k in _UNSUPPORTED_AUTH if user.get(k)]:
        raise ValueError(
            f"{where}: user {user_name!r} authenticates with {'/'.join(bad)}, which pdgate does not "
            "support: give it a token, tokenFile or client certificate"
        )

    def file(section: dict[str, Any], key: str, folder: Path) -> str | None:
        value = section.get(key)
        if not value:
            return None
        path = folder / os.path.expanduser(str(value))
        if not path.is_file():
            raise ValueError(f"{where}: {key} {path} does not exist")
        return str(path)

    def data(section: dict[str, Any], key: str) -> bytes | None:
        value = section.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: {key} is not base64") from None

    ca_data = data(cluster, "certificate-authority-data")
    kc = Kubeconfig(
        server=server.rstrip("/"),
        namespace=context.get("namespace") or None,
        ca_file=file(cluster, "certificate-authority", cluster_dir),
        ca_data=ca_data.decode("ascii", "replace") if ca_data else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=str(user["token"]) if user.get("token") else None,
        token_file=file(user, "tokenFile", user_dir),
        cert_file=file(user, "client-certificate", user_dir),
        cert_data=data(user, "client-certificate-data"),
        key_file=file(user, "client-key", user_dir),
        key_data=data(user, "client-key-data"),
    )
    if bool(kc.cert_file or kc.cert_data) != bool(kc.key_file or kc.key_data):
        raise ValueError(f"{where}: user {user_name!r} has a client certificate without its key, or a key without it")
    return kc


def _kubeconfig_access(cfg: DiscoveryConfig, paths: list[str], field: str) -> Access:
    """Access from a kubeconfig; a ``ca_file`` or ``token_file`` the config names explicitly wins."""
    try:
        kc = read_kubeconfig(paths)
    except ValueError as err:
        raise AccessError(field, str(err) if cfg.kubeconfig else f"$KUBECONFIG: {err}") from None
    ctx = None
    if kc.server.startswith("https://"):
        ca = _explicit(cfg, "ca_file")
        if ca and not Path(ca).is_file():
            raise AccessError("ca_file", f"{ca} does not exist")
        if ca:
            ctx = ssl.create_default_context(cafile=ca)
        else:
            ctx = ssl.create_default_context(cafile=kc.ca_file, cadata=kc.ca_data)
            if kc.insecure and not (kc.ca_file or kc.ca_data):
                log.warning(
                    "discovery: kubeconfig cluster %s has insecure-skip-tls-verify: the API server's "
                    "certificate is not verified",
                    kc.server,
                )
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
        if kc.cert_file or kc.cert_data:
            try:
                _load_client_cert(ctx, kc)
            except (OSError, ssl.SSLError) as err:
                raise AccessError(field, f"{', '.join(paths)}: cannot load the client certificate ({err})") from None
    token_file = _explicit(cfg, "token_file") or kc.token_file
    return Access(
        kc.server, ctx, token_file, cfg.namespace or kc.namespace or "default", None if token_file else kc.token
    )


def _load_client_cert(ctx: ssl.SSLContext, kc: Kubeconfig) -> None:
    """``ssl`` loads certificates from files only: inline data goes through a private temporary
    folder that is gone once they are loaded."""
    with tempfile.TemporaryDirectory(prefix="pdgate-kube-") as tmp:
        cert, key = kc.cert_file, kc.key_file
        if kc.cert_data:
            cert = os.path.join(tmp, "client.crt")
            Path(cert).write_bytes(kc.cert_data)
        if kc.key_data:
            key = os.path.join(tmp, "client.key")
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(kc.key_data)
        assert cert is not None
        ctx.load_cert_chain(cert, key)


# -- the watch stream -----------------------------------------------------------------------------


class _Lines:
    """Splits a watch stream into its newline-ended events in linear time: each byte is scanned
    once and copied at most twice, whatever the chunking; an event over ``limit`` bytes raises
    EventTooLarge before it is held whole."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._part = bytearray()  # the start of an event whose newline has not arrived

    def feed(self, chunk: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if self._part:
                self._check(len(self._part) + end - start)
                self._part += memoryview(chunk)[start:end]
                line = bytes(self._part)
                self._part.clear()
            else:
                self._check(end - start)
                line = chunk[start:end]
            lines.append(line)
            start = end + 1
        self._check(len(self._part) + len(chunk) - start)
        self._part += memoryview(chunk)[start:]
        return lines

    def rest(self) -> bytes:
        """What came after the last newline (a server may end the stream without one)."""
        return bytes(self._part)

    def _check(self, size: int) -> None:
        if size > self._limit:
            raise EventTooLarge(f"a watch event is over {self._limit} bytes (max_event_bytes)")


def _host(address: str, address_type: str) -> str:
    return f"[{address}]" if address_type == "IPv6" or ":" in address else address


def _port(slice_: dict[str, Any], want: int | str | None) -> int | None:
    if isinstance(want, int):
        return want
    ports = [p for p in slice_.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    if want is None:
        return int(ports[0]["port"]) if ports else None
    return next((int(p["port"]) for p in ports if p.get("name") == want), None)


def ready_endpoints(
    slices: dict[str, dict[str, Any]], cfg: DiscoveryConfig, nodes: Mapping[str, Mapping[str, str]] | None = None
) -> tuple[EndpointConfig, ...]:
    """The ready endpoints of ``slices`` as the pool's endpoint configs, sorted by URL, each with its
    topology: the slice's ``zone`` and, from ``nodes`` (labels by Node name), its Node's
    ``node_labels``."""
    found: dict[str, EndpointConfig] = {}
    nodes = nodes or {}
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
                topology=_topology(ep, nodes),
            )
    return tuple(found[u] for u in sorted(found))


def _topology(ep: Mapping[str, Any], nodes: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    where = dict(nodes.get(ep.get("nodeName") or "", {}))
    zone = ep.get("zone")
    if isinstance(zone, str) and zone and LABEL_VALUE.fullmatch(zone) and len(zone) <= 63:
        where[ZONE] = zone
    return where


def _node_names(slices: Mapping[str, Mapping[str, Any]]) -> set[str]:
    return {
        name
        for s in slices.values()
        for ep in s.get("endpoints") or []
        if isinstance(name := ep.get("nodeName"), str) and name
    }


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
        self._session: aiohttp.ClientSession | None = None
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

    async def _run(self) -> None:
        backoff = self.cfg.retry_s
        while True:
            try:
                access = await asyncio.to_thread(_access, self.cfg)
                break
            except (OSError, ValueError) as err:  # e.g. the service account not mounted (SSLError: an OSError)
                where = f"pools.{self.pool}.discovery.{err.field}: " if isinstance(err, AccessError) else ""
                self._failed(f"cannot set up API access: {where}{err}")
                log.error("discovery (%s): %s; retrying in %.1f s", self.pool, self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.max_retry_s)
        connector = aiohttp.TCPConnector(ssl=access.ssl if access.ssl is not None else True)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            if not self.cfg.node_labels:
                await self._follow(access)
                return
            async with asyncio.TaskGroup() as tasks:  # both end when the watcher is stopped
                tasks.create_task(self._read_nodes(access), name=f"discovery-{self.pool}-nodes")
                await self._follow(access)

    async def _follow(self, access: Access) -> None:
        """List, then watch, the pool's slices, for as long as the watcher runs."""
        backoff = self.cfg.retry_s
        path = f"/apis/discovery.k8s.io/v1/namespaces/{access.namespace}/endpointslices"
        listed = False  # False: the next step is a full list (at the start and after a 410)
        while True:
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)
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
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, APIError) as err:
                self._failed(f"{type(err).__name__}: {err}")
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

    async def _read_nodes(self, access: Access) -> None:
        """Reads ``node_labels`` of each Node the endpoints run on, once per Node: a Node's topology
        labels (its zone, its EC2 network spine) do not change while it lives. A Node that cannot be
        read (no RBAC for nodes, an API error) is asked again after the next full list."""
        while True:
            await self._nodes_wanted.wait()
            self._nodes_wanted.clear()
            for name in sorted(_node_names(self._slices) - self._nodes.keys() - self._nodes_failed):
                try:
                    self._nodes[name] = await self._node(access, name)
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

    async def _node(self, access: Access, name: str) -> dict[str, str]:
        assert self._session is not None
        url = f"{access.url}/api/v1/nodes/{quote(name, safe='')}"
        timeout = aiohttp.ClientTimeout(total=30)
        async with self._session.get(url, headers=await self._headers(access), timeout=timeout) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise APIError(f"answered {resp.status}: {body[:200].decode(errors='replace')}")
        labels = _labels(orjson.loads(body))
        return {
            k: v
            for k in self.cfg.node_labels
            if isinstance(v := labels.get(k), str) and len(v) <= 63 and LABEL_VALUE.fullmatch(v)
        }

    def _failed(self, why: str) -> None:
        self.errors += 1
        self.last_error = why

    async def _headers(self, access: Access) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = access.token
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
                if self._selector.matches(_labels(item)):  # the server filters; a proxy might not
                    slices[item["metadata"]["name"]] = item
            meta = data.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        self.resource_version = meta.get("resourceVersion")
        self.lists += 1
        self._slices = slices
        self._nodes_failed.clear()
        self._recompute()
        self.synced.set()

    async def _watch(self, access: Access, path: str) -> None:
        assert self._session is not None
        params = {
            "labelSelector": self.cfg.label_selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.cfg.watch_timeout_s),
        }
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
            lines = _Lines(self.cfg.max_event_bytes)
            async for chunk in resp.content.iter_any():
                for line in lines.feed(chunk):
                    if line.strip():
                        self._event(orjson.loads(line))
            if (rest := lines.rest()).strip():
                self._event(orjson.loads(rest))

    def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone
            raise APIError(f"watch error event: {obj.get('code')} {obj.get('message', '')}")
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind in ("ADDED", "MODIFIED") and self._selector.matches(_labels(obj)):
            self._slices[meta["name"]] = obj
        elif kind in ("ADDED", "MODIFIED", "DELETED"):  # gone, or its labels no longer match
            self._slices.pop(meta.get("name", ""), None)  # (no Kubernetes object is named "")
        else:  # BOOKMARK: only the resourceVersion moves
            return
        self._recompute()

    def _recompute(self) -> None:
        if self.cfg.node_labels:
            names = _node_names(self._slices)
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
        self._worker: asyncio.Task[None] | None = None

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
                log.warning(
                    "discovery: the first list has not completed in %.0f s; serving with the "
                    "static endpoints until it does",
                    wait_s,
                )
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
            cancel_checkpoint()  # a cancel a library swallowed ends the loop here (gateway/background.py)

    async def close(self) -> None:
        """Stop every watcher and the worker, all at once and within one bound (gateway/background.py)."""
        watchers = list(self.watchers.values())
        self.watchers.clear()
        worker, self._worker = self._worker, None
        await asyncio.gather(*(w.stop() for w in watchers), stop_task(worker))
