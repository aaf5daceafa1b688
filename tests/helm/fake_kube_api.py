"""A stand-in Kubernetes API server for `helm template --dry-run=server`: just what Helm's `lookup`
needs (discovery of the core group, one namespace, and the PersistentVolumeClaims named on the
command line), so that the chart's checks against a live cluster run for real, offline.

    python -m tests.helm.fake_kube_api PORT NAMESPACE [CLAIM,CLAIM...]
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _resource(name: str, kind: str, namespaced: bool) -> dict:
    return {"name": name, "singularName": "", "namespaced": namespaced, "kind": kind, "verbs": ["get", "list"]}


def serve(port: int, namespace: str, claims: set[str]) -> None:
    fixed = {
        "/version": {"major": "1", "minor": "32", "gitVersion": "v1.32.0"},
        "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
        "/api/v1": {
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": [
                _resource("namespaces", "Namespace", False),
                _resource("persistentvolumeclaims", "PersistentVolumeClaim", True),
            ],
        },
        f"/api/v1/namespaces/{namespace}": {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
    }
    prefix = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the test reads Helm's output, not ours
            pass

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in fixed:
                return self._send(200, fixed[path])
            if path.startswith(prefix) and path[len(prefix) :] in claims:
                meta = {"name": path[len(prefix) :], "namespace": namespace}
                return self._send(200, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta})
            self._send(
                404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            )

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], set(filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(","))))
