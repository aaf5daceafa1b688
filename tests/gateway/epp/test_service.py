"""The picker's gRPC services over grpclib's in-memory channel (gateway/epp/service.py): the
ext_proc stream's bounds and its answers for requests that are not inference ones, the access log
stream, and health. Routing an inference request is the end-to-end test's (tests/e2e/test_epp_envoy.py:
a real Envoy, real engines)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import orjson
import pytest
from grpclib import GRPCError
from grpclib.client import StreamStreamMethod, StreamUnaryMethod, UnaryUnaryMethod
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError
from grpclib.health.v1 import health_pb2
from grpclib.testing import ChannelFor

from gateway.epp.completions import Completions
from gateway.epp.proto import envoy_subset_pb2 as pb
from gateway.epp.service import ACCESS_LOG, EXT_PROC, AccessLogService, ExternalProcessor, Health


class Endpoint(SimpleNamespace):
    pass


def gateway(ready: bool = True, max_body: int = 100, keys: tuple[bytes, ...] = (), close: bool = True):
    decode = [
        Endpoint(url="http://10.0.0.1:8000", healthy=True, ejected=False, in_flight=3),
        Endpoint(url="http://10.0.0.2:8000", healthy=True, ejected=False, in_flight=1),
        Endpoint(url="http://10.0.0.3:8000", healthy=False, ejected=False, in_flight=0),
    ]
    pools = SimpleNamespace(decode=decode, ready=lambda: ready)
    cfg = SimpleNamespace(
        server=SimpleNamespace(max_body_bytes=max_body),
        limits=SimpleNamespace(max_header_bytes=65536),
        epp=SimpleNamespace(close_after_answer=close),
    )
    gw = SimpleNamespace(runtime=SimpleNamespace(cfg=cfg, api_keys=keys), services=SimpleNamespace(pools=pools))
    return lambda: gw


def head(path: str, method: str = "POST", eos: bool = False, *extra: tuple[str, str]) -> pb.ProcessingRequest:
    pairs = [(":path", path), (":method", method), ("content-type", "application/json"), *extra]
    hv = [pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=hv), end_of_stream=eos))


async def process(gw, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    service = ExternalProcessor(gw, Completions(60))
    async with ChannelFor([service]) as channel:
        method = StreamStreamMethod(channel, f"/{EXT_PROC}/Process", pb.ProcessingRequest, pb.ProcessingResponse)
        async with method.open() as stream:
            for m in messages:
                await stream.send_message(m)
            await stream.end()
            return [r async for r in stream]


async def test_a_body_over_the_bound_is_refused_413_before_any_routing() -> None:
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 80, end_of_stream=False))
    out = await process(gateway(max_body=100), [head("/v1/chat/completions"), body, body])
    assert len(out) == 1 and out[0].immediate_response.status.code == 413
    assert orjson.loads(out[0].immediate_response.body)["error"]["type"] == "invalid_request_error"


async def test_the_stream_ends_once_answered_unless_told_to_pass_the_response_phase_through() -> None:
    """``epp.close_after_answer``: the picker ends the stream after its answer (Envoy skips the
    filter for the rest of the request); off, it stays open and the response phase passes unchanged
    (a data plane that fails on a clean close). Either way nothing counts as being picked after."""
    response_head = pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False))
    for close in (True, False):
        service = ExternalProcessor(gateway(close=close), Completions(60))
        async with ChannelFor([service]) as channel:
            method = StreamStreamMethod(channel, f"/{EXT_PROC}/Process", pb.ProcessingRequest, pb.ProcessingResponse)
            async with method.open() as stream:
                await stream.send_message(head("/v1/models", "GET", eos=True))
                answer = await stream.recv_message()
                assert answer is not None and answer.WhichOneof("response") == "request_headers"
                for _ in range(100):  # the handler returns (close) or waits for more (open)
                    if not service.picking:
                        break
                    await asyncio.sleep(0.01)
                if close:  # ended: a later message gets no answer (Envoy would not send one)
                    with contextlib.suppress(StreamTerminatedError):
                        await stream.send_message(response_head, end=True)
                    assert await stream.recv_message() is None
                else:
                    await stream.send_message(response_head)
                    passed = await stream.recv_message()
                    assert passed == pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                    await stream.end()
                    assert await stream.recv_message() is None
        assert service.picking == 0 and service.last_stream_at > 0


async def test_a_request_still_arriving_counts_as_being_picked() -> None:
    """A drain waits for a request whose body is still coming, not only for one being routed."""
    service = ExternalProcessor(gateway(), Completions(60))
    async with ChannelFor([service]) as channel:
        method = StreamStreamMethod(channel, f"/{EXT_PROC}/Process", pb.ProcessingRequest, pb.ProcessingResponse)
        async with method.open() as stream:
            await stream.send_message(head("/v1/chat/completions"))
            await stream.send_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{", end_of_stream=False)))
            for _ in range(100):
                if service.picking:
                    break
                await asyncio.sleep(0.01)
            assert service.picking == 1
            await stream.cancel()  # the client left
    for _ in range(100):
        if not service.picking:
            break
        await asyncio.sleep(0.01)
    assert service.picking == 0


async def test_a_request_that_is_not_an_inference_one_goes_to_the_least_busy_usable_engine() -> None:
    out = await process(gateway(), [head("/v1/models", "GET", eos=True)])
    assert [r.WhichOneof("response") for r in out] == ["request_headers"]  # no body: no body answer
    sets = {
        o.header.key: o.header.raw_value.decode() for o in out[0].request_headers.response.header_mutation.set_headers
    }
    assert sets["x-gateway-destination-endpoint"] == "10.0.0.2:8000,10.0.0.1:8000"  # fewest in flight first


async def test_an_engines_other_routes_are_not_the_clients_to_reach() -> None:
    for path, method in (("/v1/load_lora_adapter", "POST"), ("/reset_prefix_cache", "POST"), ("/metrics", "GET")):
        out = await process(gateway(), [head(path, method, eos=True)])
        assert out[0].immediate_response.status.code == 404, path


async def test_the_model_list_needs_the_api_key_serve_asks_for() -> None:
    gw = gateway(keys=(b"sk-1",))
    out = await process(gw, [head("/v1/models", "GET", True)])
    assert out[0].immediate_response.status.code == 401
    out = await process(gw, [head("/v1/models", "GET", True, ("authorization", "Bearer sk-1"))])
    assert out[0].WhichOneof("response") == "request_headers"


async def test_a_subset_hint_that_allows_no_usable_engine_is_answered_503() -> None:
    h = head("/v1/models", "GET", eos=True)
    h.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": ["10.0.0.3:8000"]}  # the unhealthy one
    )
    out = await process(gateway(), [h])
    assert out[0].immediate_response.status.code == 503


async def test_access_log_entries_end_held_requests() -> None:
    completions = Completions(60)
    ended: list[int] = []
    held = SimpleNamespace(held=True, served=lambda status, *rest: ended.append(status), unconfirmed=lambda: None)
    completions.hold("r1", held)
    message = pb.StreamAccessLogsMessage(identifier=pb.StreamAccessLogsMessage.Identifier(log_name="pdgate"))
    e = message.http_logs.log_entry.add()
    e.request.request_headers["x-request-id"] = "r1"
    e.response.response_code.value = 200
    async with ChannelFor([AccessLogService(completions)]) as channel:
        method = StreamUnaryMethod(
            channel, f"/{ACCESS_LOG}/StreamAccessLogs", pb.StreamAccessLogsMessage, pb.StreamAccessLogsResponse
        )
        async with method.open() as stream:
            await stream.send_message(message)
            await stream.end()
            await stream.recv_message()
    assert ended == [200] and len(completions) == 0


@pytest.mark.parametrize(
    ("ready", "name", "expected"),
    [
        (False, "liveness", health_pb2.HealthCheckResponse.SERVING),
        (True, "readiness", health_pb2.HealthCheckResponse.SERVING),
        (False, "readiness", health_pb2.HealthCheckResponse.NOT_SERVING),
        (False, EXT_PROC, health_pb2.HealthCheckResponse.NOT_SERVING),
        (True, "", health_pb2.HealthCheckResponse.SERVING),
    ],
)
async def test_health_follows_the_decode_pool(ready: bool, name: str, expected: int) -> None:
    async with ChannelFor([Health(gateway(ready=ready))]) as channel:
        check = UnaryUnaryMethod(
            channel, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        )
        reply = await check(health_pb2.HealthCheckRequest(service=name))
    assert reply.status == expected


async def test_health_of_an_unknown_service_is_not_found() -> None:
    async with ChannelFor([Health(gateway())]) as channel:
        check = UnaryUnaryMethod(
            channel, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        )
        with pytest.raises(GRPCError) as err:
            await check(health_pb2.HealthCheckRequest(service="nope"))
    assert err.value.status is Status.NOT_FOUND
