"""An OTLP/HTTP traces receiver on loopback, for tests where real processes export spans."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.procs import free_port


def attrs(item: Any) -> dict[str, Any]:
    """A span's (or resource's) attributes as plain values."""
    out = {}
    for a in item.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


class Collector:
    """Keeps every span it is sent, and the resource attributes of the process that sent it."""

    def __init__(self) -> None:
        self.spans: list = []
        self.resources: dict[bytes, dict[str, Any]] = {}  # span_id -> its resource's attributes
        spans, resources, lock = self.spans, self.resources, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    for rs in req.resource_spans:
                        res = attrs(rs.resource)
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                resources[s.span_id] = res
                            spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def trace(self, trace_id: str) -> list:
        return [s for s in list(self.spans) if s.trace_id.hex() == trace_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
