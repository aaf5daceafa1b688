"""Proposal 004 in ext_proc messages (gateway/epp/protocol.py): what the picker reads and the
answers it builds, in the order Envoy requires."""

from __future__ import annotations

import orjson
from google.protobuf import json_format

from gateway.epp import protocol
from gateway.epp.proto import envoy_subset_pb2 as pb
from gateway.http.errors import APIError


def headers(*pairs: tuple[str, str], eos: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(
        headers=pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=eos,
    )


def test_an_engine_url_becomes_the_address_envoy_routes_to() -> None:
    assert protocol.host_port("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert protocol.host_port("http://10.0.0.7") == "10.0.0.7:80"
    assert protocol.host_port("https://10.0.0.7/v1") == "10.0.0.7:443"
    assert protocol.host_port("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert protocol.is_ip_endpoint("http://10.0.0.7:8000") and protocol.is_ip_endpoint("http://[fd00::1]:80")
    assert not protocol.is_ip_endpoint("http://decode-0.engines:8000")


def test_request_headers_are_read_from_raw_values_without_pseudo_headers() -> None:
    h = headers((":path", "/v1/chat/completions"), (":method", "POST"), ("Authorization", "Bearer k"))
    assert protocol.headers_of(h) == [(b"authorization", b"Bearer k")]
    assert protocol.pseudo(h, ":path") == "/v1/chat/completions"
    assert protocol.pseudo(h, ":authority") is None
    legacy = pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key="x-a", value="1")]))
    assert protocol.headers_of(legacy) == [(b"x-a", b"1")]  # an Envoy that sends `value`


def test_the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() -> None:
    req = pb.ProcessingRequest()
    assert protocol.subset_hint(req) is None  # no hint: any endpoint
    req.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
        {protocol.SUBSET_KEY: ["10.0.0.1:8000", "10.0.0.2:8000"]}
    )
    assert protocol.subset_hint(req) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    req.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update(
        {protocol.SUBSET_KEY: "10.0.0.3:1, 10.0.0.4:2"}
    )
    assert protocol.subset_hint(req) == {"10.0.0.3:1", "10.0.0.4:2"}
    req.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].update({protocol.SUBSET_KEY: []})
    assert protocol.subset_hint(req) == frozenset()  # an empty subset: nothing may be picked (503)


def test_a_route_is_headers_then_the_body_in_chunks_with_the_same_destination_in_header_and_metadata() -> None:
    body = b"x" * (protocol.CHUNK_BYTES * 2 + 5)
    out = protocol.picked(
        ["10.0.0.1:8000", "10.0.0.2:8000"],
        body,
        set_headers=[("x-request-id", "r1")],
        decision={"x-pdgate-path": "pd"},
    )
    assert [r.WhichOneof("response") for r in out] == [
        "request_headers",
        "request_body",
        "request_body",
        "request_body",
    ]
    common = out[0].request_headers.response
    assert common.clear_route_cache
    sets = {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}
    assert sets == {protocol.DESTINATION: "10.0.0.1:8000,10.0.0.2:8000", "x-request-id": "r1"}
    meta = json_format.MessageToDict(out[0].dynamic_metadata)
    assert meta[protocol.LB_NAMESPACE][protocol.DESTINATION] == sets[protocol.DESTINATION]
    assert meta[protocol.PDGATE_NAMESPACE] == {"x-pdgate-path": "pd"}
    # what a client sent under the picker's names is removed, never what the picker sets
    removed = set(common.header_mutation.remove_headers)
    assert protocol.PREFILLER in removed and "x-gateway-destination-endpoint-served" in removed
    assert protocol.DESTINATION not in removed
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(c.body for c in chunks) == body
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    assert all(len(c.body) <= protocol.CHUNK_BYTES for c in chunks)


def test_a_route_without_a_body_or_with_trailers() -> None:
    assert [r.WhichOneof("response") for r in protocol.picked(["10.0.0.1:80"], None)] == ["request_headers"]
    out = protocol.picked(["10.0.0.1:80"], b"{}", trailers=True)
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream  # the trailers end it
    empty = protocol.picked(["10.0.0.1:80"], b"")
    assert empty[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_a_prefill_engine_named_for_the_sidecar_is_set_not_removed() -> None:
    out = protocol.picked(["10.0.0.1:80"], b"{}", set_headers=[(protocol.PREFILLER, "10.0.0.9:8000")])
    mutation = out[0].request_headers.response.header_mutation
    assert protocol.PREFILLER not in mutation.remove_headers
    assert any(o.header.key == protocol.PREFILLER for o in mutation.set_headers)


def test_a_refusal_is_an_immediate_openai_shaped_answer() -> None:
    err = APIError(429, "too many requests in flight", code="rate_limited", headers={"Retry-After": "1"})
    out = protocol.refused(err, [("x-request-id", "r1")])
    immediate = out.immediate_response
    assert immediate.status.code == 429
    assert orjson.loads(immediate.body) == {
        "error": {
            "message": "too many requests in flight",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    sets = {o.header.key: o.header.raw_value.decode() for o in immediate.headers.set_headers}
    assert sets == {"content-type": "application/json", "retry-after": "1", "x-request-id": "r1"}
    assert immediate.details == "pdgate_rate_limited"
