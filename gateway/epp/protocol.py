"""The endpoint picker protocol (Gateway API Inference Extension, proposal 004) in Envoy's ext_proc
messages: what the picker reads from a request's messages and the answers it builds.

The flow, with the request body in FULL_DUPLEX_STREAMED mode and the response path off (the
shipped Envoy config, deploy/envoy/): Envoy sends the request's headers, then each body chunk
without waiting; the picker answers once the body is whole, in the order Envoy requires:
the headers answer first (the destination header, ``clear_route_cache`` and the ``envoy.lb``
dynamic metadata: the same ``ip:port[,ip:port...]`` in both), then the body as streamed chunks
(Envoy drops the original body in this mode: only what the picker sends reaches the engine),
then, if the request had trailers, the trailers answer. A request it refuses gets one
``immediate_response`` (429, 503, 4xx) with an OpenAI-shaped JSON body.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import orjson
from google.protobuf import json_format

from gateway.epp.proto import envoy_subset_pb2 as pb
from gateway.http.errors import APIError

DESTINATION = "x-gateway-destination-endpoint"  # header, and key in the envoy.lb metadata
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PREFILLER = "x-prefiller-host-port"  # llm-d's decode sidecar runs the prefill leg on this engine
PDGATE_NAMESPACE = "pdgate"  # the decision, for Envoy to put in response headers and its log
CHUNK_BYTES = 62_000  # a streamed body answer's largest chunk (under Envoy's 64 KiB advice)

# Headers a client may not set for the engine: the picker's own, and what would steer the data plane.
PICKER_OWNED = (DESTINATION, SUBSET_KEY, PREFILLER, "x-gateway-destination-endpoint-served")


def host_port(url: str) -> str:
    """An engine's ``ip:port`` as proposal 004 names it (``[v6]:port`` for IPv6)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip_endpoint(url: str) -> bool:
    """Whether Envoy can route to ``url`` by address (ORIGINAL_DST and override_host take IPs only)."""
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def allowed(url: str, subset: frozenset[str]) -> bool:
    """Whether the subset hint allows ``url``: its ``ip:port``, or its address alone (the reference
    picker matches on the address)."""
    hp = host_port(url)
    return hp in subset or hp.rsplit(":", 1)[0] in subset


def headers_of(message: pb.HttpHeaders) -> list[tuple[bytes, bytes]]:
    """The request's headers as ASGI has them (lower-case names; Envoy sends values in ``raw_value``),
    pseudo-headers (``:path``...) left out."""
    out = []
    for h in message.headers.headers:
        if h.key.startswith(":"):
            continue
        out.append((h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1")))
    return out


def pseudo(message: pb.HttpHeaders, name: str) -> str | None:
    """A pseudo-header's value (``:path``, ``:method``, ``:authority``)."""
    for h in message.headers.headers:
        if h.key == name:
            return (h.raw_value or h.value.encode("latin-1")).decode("latin-1")
    return None


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The data plane's subset hint: the ``ip:port`` endpoints it allows (None: no hint, any).
    Its value is a list of strings; a comma-separated string is read too."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    fields = json_format.MessageToDict(meta[SUBSET_NAMESPACE])
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    items: Iterable[object] = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else ()
    return frozenset(str(v).strip() for v in items if str(v).strip())


def picked(
    endpoints: Sequence[str],
    body: bytes | None,
    *,
    set_headers: Sequence[tuple[str, str]] = (),
    remove_headers: Sequence[str] = (),
    decision: dict[str, str] | None = None,
    trailers: bool = False,
) -> list[pb.ProcessingResponse]:
    """The answers for a routed request: headers (destination first, then ``set_headers``), then the
    body in chunks (None: the request had none), then (``trailers``: it had some) the trailers' answer."""
    destination = ",".join(endpoints)
    sets = [(DESTINATION, destination), *set_headers]
    named = {name for name, _ in sets}
    # what a client sent under the picker's names goes (a set header overwrites its own name)
    gone = [h for h in (*PICKER_OWNED, "content-length", *remove_headers) if h not in named]
    mutation = pb.HeaderMutation(remove_headers=gone)
    for name, value in sets:
        mutation.set_headers.append(pb.HeaderValueOption(header=pb.HeaderValue(key=name, raw_value=value.encode())))
    head = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True))
    )
    meta: dict[str, dict[str, str]] = {LB_NAMESPACE: {DESTINATION: destination}}
    if decision:
        meta[PDGATE_NAMESPACE] = decision
    head.dynamic_metadata.update(meta)
    out = [head]
    if body is None:
        return out
    chunks = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1 and not trailers
        streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=last)
        out.append(
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(
                    response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
                )
            )
        )
    if trailers:
        out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
    return out


def refused(err: APIError, headers: Sequence[tuple[str, str]] = ()) -> pb.ProcessingResponse:
    """An answer Envoy sends the client itself: ``err`` in the OpenAI shape, as ``serve`` answers it."""
    mutation = pb.HeaderMutation()
    for name, value in (("content-type", "application/json"), *err.headers.items(), *headers):
        mutation.set_headers.append(
            pb.HeaderValueOption(header=pb.HeaderValue(key=name.lower(), raw_value=value.encode()))
        )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=pb.HttpStatus(code=err.status),
            headers=mutation,
            body=orjson.dumps(err.body()),
            details=f"pdgate_{err.code or 'refused'}",
        )
    )
