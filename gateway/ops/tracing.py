"""OpenTelemetry spans for one request: a server span with tokenize, route and engine-leg children.

The app owns its TracerProvider (never the process-global one), so two apps in one process (tests)
keep their spans apart. With tracing off, every request gets ``NO_TRACE``, whose methods do
nothing: the request path calls them unconditionally and pays no more than a method call.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TracingConfig

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent/tracestate
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x21-\x7e ,=]*")


def _env_headers(name: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` from the environment (OTEL_EXPORTER_OTLP_HEADERS' format)."""
    raw = os.environ.get(name, "") if name else ""
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def make_exporter(cfg: TracingConfig) -> SpanExporter | None:
    if cfg.exporter == "console":
        return ConsoleSpanExporter()
    if cfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=cfg.endpoint, headers={**cfg.headers, **_env_headers(cfg.headers_env)})
    return None


class Tracing:
    """The app's tracer. ``exporter`` (tests: the SDK's in-memory one) overrides the config's and
    exports each span as it ends."""

    def __init__(self, cfg: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self._provider: TracerProvider | None = None
        self.tracer: Tracer | None = None
        processor: SpanProcessor
        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        else:
            configured = make_exporter(cfg)
            if configured is None:
                return
            processor = BatchSpanProcessor(configured)  # exports on its own thread, off the event loop
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
        )
        self._provider.add_span_processor(processor)
        self.tracer = self._provider.get_tracer("pdgate")

    def start(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> RequestTrace:
        """The server span of one request, joined to the client's trace when it sent a traceparent.
        With tracing off, a client's valid traceparent (and tracestate) still goes on to the
        engines unchanged, so their spans join the client's trace."""
        if self.tracer is None:
            parent_header = headers.get("traceparent")
            if parent_header is None or not _TRACEPARENT.fullmatch(parent_header):
                return NO_TRACE
            carried = {"traceparent": parent_header}
            state = headers.get("tracestate")
            if state and len(state) <= 512 and _TRACESTATE.fullmatch(state):
                carried["tracestate"] = state
            return RequestTrace(None, None, carried)
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what the batch processor still holds


class LegSpan:
    """One engine leg (CLIENT span); ``headers`` carry its traceparent to the engine."""

    __slots__ = ("_span", "headers")

    def __init__(self, span: Span | None, headers: dict[str, str] | None = None) -> None:
        self._span = span
        self.headers: dict[str, str] = headers if headers is not None else {}
        if span is not None:
            _PROPAGATOR.inject(self.headers, context=set_span_in_context(span))

    def set(self, key: str, value: Any) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)

    def end(self, error: str | None = None) -> None:
        span, self._span = self._span, None  # ends once, whoever comes first
        if span is None:
            return
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


NO_LEG = LegSpan(None)


class RequestTrace:
    """The spans of one request; all end at the latest when the server span does."""

    __slots__ = ("_context", "_open", "_passed_on", "_tracer", "span")

    def __init__(self, tracer: Tracer | None, span: Span | None, passed_on: dict[str, str] | None = None) -> None:
        self._tracer = tracer
        self.span = span
        self._context: Context | None = set_span_in_context(span) if span is not None else None
        self._open: list[LegSpan] = []
        self._passed_on = passed_on  # tracing off: the client's trace headers, for the engines

    def record(self, name: str, duration_ns: int, attributes: dict[str, Any]) -> None:
        """A step (tokenize, route) that just ended, timed by the caller: no context manager on
        the request path. Only call it when ``span`` is set (building attributes costs)."""
        if self._tracer is None:
            return
        end = time.time_ns()
        child = self._tracer.start_span(
            name, context=self._context, start_time=end - duration_ns, attributes=attributes
        )
        child.end(end_time=end)

    def leg(self, name: str, url: str) -> LegSpan:
        if self._tracer is None:
            return NO_LEG if self._passed_on is None else LegSpan(None, self._passed_on)
        span = self._tracer.start_span(
            name, context=self._context, kind=SpanKind.CLIENT, attributes={"pdgate.leg": name, "server.address": url}
        )
        leg = LegSpan(span)
        self._open.append(leg)
        return leg

    def child(self, name: str, attributes: dict[str, Any]) -> tuple[LegSpan, RequestTrace]:
        """A step inside this span that has engine legs of its own (a migration): its handle, to
        set attributes and end it, and the trace its legs go in. It ends with the request at the
        latest."""
        if self._tracer is None:
            return NO_LEG, self if self.span is None else RequestTrace(None, None)
        span = self._tracer.start_span(name, context=self._context, attributes=attributes)
        handle = LegSpan(span, {})
        self._open.append(handle)
        inner = RequestTrace(self._tracer, span)
        inner._open = self._open  # its legs too
        return handle, inner

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes)

    def set(self, attributes: dict[str, Any]) -> None:
        if self.span is not None:
            self.span.set_attributes(attributes)

    def end(self, status: int, error: str = "") -> None:
        if self.span is None:
            return
        for leg in self._open:  # a leg the relay never got to close (the client left, a bug)
            leg.end()
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:  # a client's mistake (4xx) is not the server span's error
            self.span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        self.span.end()


NO_TRACE = RequestTrace(None, None)
