"""The picker's gRPC services: Envoy's ext_proc stream per request, its access log stream, and
gRPC health (grpclib; one listener, ``epp.port``).

``ExternalProcessor.process`` reads a request's headers and body chunks as Envoy streams them
(FULL_DUPLEX_STREAMED), bounded by ``server.max_body_bytes`` (413 past it), routes the request
once its body is whole (gateway/epp/picking.py) and answers in the order Envoy requires
(gateway/epp/protocol.py). ``GET /v1/models`` and ``/health`` (with the client's API key
checked) go to the decode engine with the fewest requests in flight, unchanged; any other route is
refused (404). A stream Envoy drops (the
client left) cancels the pick, and with it a prefill leg under way.

Health answers ``liveness`` (serving while the process runs), and ``readiness``, the ext_proc
service's name and ``""`` (serving while the decode pool can take requests, as ``GET /ready``,
and the picker is not draining).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from grpclib import GRPCError
from grpclib.const import Cardinality, Handler, Status
from grpclib.health.v1 import health_pb2
from grpclib.health.v1.health_grpc import HealthBase
from grpclib.server import Stream

from gateway.epp import protocol
from gateway.epp.completions import Completions
from gateway.epp.picking import Picked, PickExchange, request_of
from gateway.epp.proto import envoy_subset_pb2 as pb
from gateway.http.auth import authorize
from gateway.http.errors import APIError
from gateway.request.protocol import too_large

if TYPE_CHECKING:
    from gateway.http.handlers import Gateway

log = logging.getLogger(__name__)

EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG = "envoy.service.accesslog.v3.AccessLogService"
_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_PASSED = frozenset({"/v1/models", "/health"})  # the engine's own answer is the same as serve's

ProcessStream = Stream[pb.ProcessingRequest, pb.ProcessingResponse]


class ExternalProcessor:
    """``envoy.service.ext_proc.v3.ExternalProcessor/Process``: one stream per request."""

    def __init__(self, gateway: Callable[[], Gateway], completions: Completions) -> None:
        self._gateway = gateway
        self.completions = completions
        self.picking = 0  # requests between their first message and their answer (a drain waits on them)
        self.last_stream_at = 0.0  # when the latest ext_proc stream began (time.monotonic)

    def __mapping__(self) -> dict[str, Handler]:
        return {
            f"/{EXT_PROC}/Process": Handler(
                self.process, Cardinality.STREAM_STREAM, pb.ProcessingRequest, pb.ProcessingResponse
            )
        }

    async def process(self, stream: ProcessStream) -> None:
        """Read until the request is whole and answer. Then, with ``epp.close_after_answer`` (the
        default), close the stream: the API lets a processor close once it needs no more messages,
        Envoy skips the filter for the rest of the request, and the stream does not stay open for
        as long as the answer streams. Otherwise the response phase is passed through unchanged."""
        self.picking += 1  # from the first message: a drain waits for requests still arriving
        self.last_stream_at = time.monotonic()
        answered = False
        try:
            head: pb.HttpHeaders | None = None
            subset: frozenset[str] | None = None
            chunks: list[bytes] = []
            size = 0
            async for message in stream:
                which = message.WhichOneof("request")
                if which in _RESPONSE_PHASE:  # a data plane that sends it: nothing to change
                    await stream.send_message(_pass(which))
                    continue
                if answered:
                    continue
                if which == "request_headers":
                    head = message.request_headers
                    subset = protocol.subset_hint(message)
                    if head.end_of_stream:  # no body (GET /v1/models, ...)
                        await self._answer(stream, head, subset, None, trailers=False)
                        answered = True
                elif which == "request_body" and head is not None:
                    chunks.append(message.request_body.body)
                    size += len(message.request_body.body)
                    limit = self._gateway().runtime.cfg.server.max_body_bytes
                    if size > limit:
                        await stream.send_message(protocol.refused(too_large(limit)))
                        return
                    if message.request_body.end_of_stream:
                        await self._answer(stream, head, subset, b"".join(chunks), trailers=False)
                        answered = True
                elif which == "request_trailers" and head is not None:
                    await self._answer(stream, head, subset, b"".join(chunks), trailers=True)
                    answered = True
                if answered:
                    self.picking -= 1  # picked: what follows is the answer's, not the pick's
                    if self._gateway().runtime.cfg.epp.close_after_answer:
                        return
        finally:
            if not answered:
                self.picking -= 1

    async def _answer(
        self,
        stream: ProcessStream,
        head: pb.HttpHeaders,
        subset: frozenset[str] | None,
        body: bytes | None,
        *,
        trailers: bool,
    ) -> None:
        path = protocol.pseudo(head, ":path") or "/"
        method = protocol.pseudo(head, ":method") or "GET"
        headers = protocol.headers_of(head)
        kind = _ROUTES.get(path.partition("?")[0])
        if kind is None or method != "POST":
            picked = self._other_route(path.partition("?")[0], method, headers, subset)
        else:
            gw = self._gateway()
            exchange = PickExchange(
                gw.runtime,
                gw.services,
                request_of(headers, method, path, body or b""),
                "chat" if kind == "chat" else "completion",
                path.partition("?")[0],
                gw.runtime.cfg.epp,
            )
            picked = await exchange.pick(subset)
            if exchange.held:
                self.completions.hold(exchange.rec.request_id, exchange)
        if picked.refusal is not None:
            await stream.send_message(protocol.refused(picked.refusal, picked.headers))
            return
        for response in protocol.picked(
            picked.endpoints,
            picked.body if body is not None else None,
            set_headers=picked.headers,
            decision=picked.decision,
            trailers=trailers,
        ):
            await stream.send_message(response)

    def _other_route(
        self, path: str, method: str, headers: list[tuple[bytes, bytes]], subset: frozenset[str] | None
    ) -> Picked:
        """A request that is not an inference one. Only what ``serve`` answers to clients goes on
        (``GET /v1/models`` and ``/health``, with the API key ``serve`` asks for); an engine's other
        routes (``/v1/load_lora_adapter``, ``/reset_prefix_cache``, ``/metrics``...) are not the
        client's to reach: 404."""
        if method != "GET" or path not in _PASSED:
            return Picked(refusal=APIError(404, f"{method[:16]} {path[:200]}: not served here.", code="not_found"))
        rt = self._gateway().runtime
        try:
            authorize(request_of(headers, method, path, b""), rt.api_keys, rt.cfg.limits.max_header_bytes)
        except APIError as err:
            return Picked(refusal=err)
        return self._any(subset)

    def _any(self, subset: frozenset[str] | None) -> Picked:
        """Any usable decode engine, fewest in flight first."""
        pools = self._gateway().services.pools
        usable = [
            e
            for e in pools.decode
            if e.healthy and not e.ejected and (subset is None or protocol.allowed(e.url, subset))
        ]
        if not usable:
            return Picked(
                refusal=APIError(503, "No engine is ready.", code="no_engine", type_="ServiceUnavailableError")
            )
        usable.sort(key=lambda e: e.in_flight)
        return Picked(endpoints=[protocol.host_port(e.url) for e in usable[:3]])


_RESPONSE_PHASE = frozenset({"response_headers", "response_body", "response_trailers"})


def _pass(which: str) -> pb.ProcessingResponse:
    """An answer that changes nothing, for the response phase's messages."""
    if which == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if which == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class AccessLogService:
    """``envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs``: Envoy's entries end held
    requests (gateway/epp/completions.py)."""

    def __init__(self, completions: Completions) -> None:
        self.completions = completions

    def __mapping__(self) -> dict[str, Handler]:
        return {
            f"/{ACCESS_LOG}/StreamAccessLogs": Handler(
                self.stream_access_logs,
                Cardinality.STREAM_UNARY,
                pb.StreamAccessLogsMessage,
                pb.StreamAccessLogsResponse,
            )
        }

    async def stream_access_logs(self, stream: Stream[pb.StreamAccessLogsMessage, pb.StreamAccessLogsResponse]) -> None:
        async for message in stream:
            if message.WhichOneof("log_entries") == "http_logs":
                for entry in message.http_logs.log_entry:
                    self.completions.report(entry)
        await stream.send_message(pb.StreamAccessLogsResponse())


class Health(HealthBase):
    """gRPC health as proposal 004 asks: liveness, readiness and the ext_proc service's name.
    A draining picker is not ready: Envoy's health check (the shipped config's) moves new
    requests to the other pickers while this one finishes what it has."""

    def __init__(self, gateway: Callable[[], Gateway], draining: Callable[[], bool] = lambda: False) -> None:
        self._gateway = gateway
        self._draining = draining

    async def Check(self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        name = request.service
        if name == "liveness":
            serving = True
        elif name in ("readiness", EXT_PROC, ""):
            serving = not self._draining() and self._gateway().services.pools.ready()
        else:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {name[:100]!r}")
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await stream.send_message(health_pb2.HealthCheckResponse(status=status))

    async def Watch(self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]) -> None:
        raise GRPCError(Status.UNIMPLEMENTED, "Watch is not served; use Check")
