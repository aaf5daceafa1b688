"""Engine discovery through the Kubernetes API: EndpointSlices (discovery.k8s.io/v1) by label selector,
through kubernetes_asyncio (the maintained asyncio client, on the aiohttp the gateway already uses).

Each pool with a ``discovery`` section gets one ``SliceWatcher`` (``watcher``): it lists the matching
slices (page by page, following ``continue``), then watches from the list's resourceVersion (the
library's ``Watch``, bookmarks on), renewing the watch when the server ends it. Only 410 Gone (as an
HTTP status or as an ERROR event: the resourceVersion is too old) starts over with a fresh list,
after a short pause; any other failure of a watch re-watches from the last resourceVersion seen
after a growing pause (a failed list is retried the same way). The pool's discovered endpoints
(``endpoints``) are the ready endpoints (``conditions.ready`` true or unset, as the API says to read
it) of every matching slice of the configured address family (``address_type``: a dual-stack
Service has one IPv4 and one IPv6 slice per pod set, and counting both would list each pod twice):
the first address of each, with the configured port. ``Discovery`` (``manager``) adds them to the
static endpoints of the config in force (``effective``) and tells the app when the set changes,
which then updates the pools the way a config reload does. A watcher replaced by a reload (its
discovery section changed) hands its endpoints to its successor, which keeps them until its own
first list completes.

The API is reached (``access``) through ``api_url`` (with ``token_file`` and ``ca_file``), a
kubeconfig (``kubeconfig``, or ``$KUBECONFIG`` when not in a cluster: token, ``tokenFile``, client
certificate or ``exec`` plugin such as ``aws eks get-token``), or in-cluster (the service account).
Credentials stay fresh: the client awaits a hook before every request, which re-reads a token file
on a worker thread (projected service-account tokens rotate) or takes the exec plugin's token from
the library's loader (``load_from_exec_plugin``), which runs the plugin again once the token nears
its ``expirationTimestamp``.

The API server filters by ``labelSelector``; the watcher checks every slice against the selector
too (``selector``: the library has no matcher), so what it follows never depends on a server or
proxy honoring it, and a slice whose labels stop matching leaves the pool (a real server reports
that as DELETED). A watch event longer than ``max_event_bytes`` ends the watch with an error and a
fresh list; memory per event is bounded by the client's own line limit (aiohttp's, 4 MiB).

Nothing blocks the event loop for long: HTTP through aiohttp, the kubeconfig, namespace and token
files read and an exec plugin's first run on a worker thread (later runs are asyncio subprocesses).
The one file read left on the loop is the client's TLS context (CA, client certificate), built once
per watcher when the library's ``ApiClient`` (and its ``Watch``) is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .endpoints import ready_endpoints
from .manager import POOLS, Discovery
from .selector import LABEL_KEY, LABEL_VALUE, LabelSelector

if TYPE_CHECKING:
    from .access import AccessError, check_files
    from .watcher import SliceWatcher

# kubernetes_asyncio's client (every API model class) holds ~43 MB of a worker's memory: imported
# only once a pool has a discovery section (its watcher, or the config check of its files), never
# in a gateway with static endpoints only.
_LAZY = {"AccessError": ".access", "check_files": ".access", "SliceWatcher": ".watcher"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LABEL_KEY",
    "LABEL_VALUE",
    "POOLS",
    "AccessError",
    "Discovery",
    "LabelSelector",
    "SliceWatcher",
    "check_files",
    "ready_endpoints",
]
