"""A stand-in Kubernetes API server for `helm template --dry-run=server`: just what Helm's `lookup`
needs (discovery of the core group, PersistentVolumeClaims and Secrets of one namespace), so that
the chart's checks against a live cluster run for real, offline. Anything else is 403 Forbidden, as
for a deployer whose rights end at its namespace's objects (reading the Namespace itself included).

    python -m tests.helm.fake_kube_api PORT NAMESPACE STATE_JSON

STATE_JSON: {"claims": ["models-fsx"], "secrets": {"hf-token": ["HF_TOKEN"]}}
"""

from __future__ import annotations

import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _resource(name: str, kind: str, namespaced: bool) -> dict:
    return {"name": name, "singularName": "", "namespaced": namespaced, "kind": kind, "verbs": ["get", "list"]}


def serve(port: int, namespace: str, claims: list[str], secrets: dict[str, list[str]]) -> None:
    def pvc(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace}}

    def secret(name: str) -> dict:
        data = {key: base64.b64encode(b"x").decode() for key in secrets[name]}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": data}

    def listing(kind: str, items: list[dict]) -> dict:
        return {"apiVersion": "v1", "kind": f"{kind}List", "metadata": {"resourceVersion": "1"}, "items": items}

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
                _resource("secrets", "Secret", True),
            ],
        },
        f"/api/v1/namespaces/{namespace}/persistentvolumeclaims": listing(
            "PersistentVolumeClaim", [pvc(c) for c in claims]
        ),
        f"/api/v1/namespaces/{namespace}/secrets": listing("Secret", [secret(s) for s in secrets]),
    }
    gets = {
        **{f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{c}": pvc(c) for c in claims},
        **{f"/api/v1/namespaces/{namespace}/secrets/{s}": secret(s) for s in secrets},
    }
    ours = f"/api/v1/namespaces/{namespace}/"

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
            if path in gets:
                return self._send(200, gets[path])
            if path.startswith(ours):
                return self._send(
                    404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
                )
            self._send(
                403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403}
            )

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    state = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    serve(int(sys.argv[1]), sys.argv[2], list(state.get("claims", [])), dict(state.get("secrets", {})))
