"""``pdgate epp`` (gateway/cli.py) and the picker's listener in the lifecycle (gateway/epp/server.py):
a config Envoy cannot route refused in one line; the listener answers health, stops within its
bound and releases what it held."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import yaml
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from gateway.config import EppConfig
from gateway.epp.server import PickerServer
from gateway.ports import free_port


def write_config(tmp_path, tokenizer_dir, decode: str) -> str:
    cfg = {
        "models": [{"name": "tiny", "tokenizer": str(tokenizer_dir), "max_model_len": 4096}],
        "pools": {"prefill": {"endpoints": []}, "decode": {"endpoints": [decode]}},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_an_engine_named_by_host_name_is_refused_in_one_line(tmp_path, tokenizer_dir) -> None:
    path = write_config(tmp_path, tokenizer_dir, "http://decode-0.engines:8000")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "epp", "--config", path], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "pools.decode: http://decode-0.engines:8000 is not an IP address" in done.stderr


async def test_the_listener_serves_health_and_stops_releasing_what_it_held() -> None:
    port = free_port()
    pools = SimpleNamespace(decode=[], ready=lambda: False)
    cfg = SimpleNamespace(epp=EppConfig(host="127.0.0.1", port=port, completion_timeout_s=60))
    registry = CollectorRegistry()
    metrics = SimpleNamespace(registry=registry)
    gw = SimpleNamespace(
        runtime=SimpleNamespace(cfg=cfg), services=SimpleNamespace(pools=pools, shared=None, metrics=metrics)
    )
    server = PickerServer(gw)  # type: ignore[arg-type]
    await server.start()
    released = []
    server.completions.hold("r1", SimpleNamespace(held=True, unconfirmed=lambda: released.append("r1")))
    assert registry.get_sample_value("pdgate_epp_held_requests") == 1
    try:
        channel = Channel("127.0.0.1", port)
        check = UnaryUnaryMethod(
            channel, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        )
        reply = await check(health_pb2.HealthCheckRequest(service="liveness"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reply = await check(health_pb2.HealthCheckRequest(service="readiness"))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no decode engine ready
        channel.close()
    finally:
        await server.stop()
    assert released == ["r1"]
    assert registry.get_sample_value("pdgate_epp_unconfirmed_requests_total") is None  # unregistered on stop


async def test_a_draining_listener_is_not_ready_serves_on_and_ends_when_nothing_is_held() -> None:
    port = free_port()
    pools = SimpleNamespace(decode=[], ready=lambda: True)
    cfg = SimpleNamespace(epp=EppConfig(host="127.0.0.1", port=port, completion_timeout_s=60))
    metrics = SimpleNamespace(registry=CollectorRegistry())
    gw = SimpleNamespace(
        runtime=SimpleNamespace(cfg=cfg), services=SimpleNamespace(pools=pools, shared=None, metrics=metrics)
    )
    server = PickerServer(gw)  # type: ignore[arg-type]
    await server.start()
    served = []
    server.completions.hold(
        "r1", SimpleNamespace(held=True, served=lambda *a: served.append(a), unconfirmed=lambda: served.append("lost"))
    )
    channel = Channel("127.0.0.1", port)
    check = UnaryUnaryMethod(
        channel, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    )
    try:
        ready = await check(health_pb2.HealthCheckRequest(service="readiness"))
        assert ready.status == health_pb2.HealthCheckResponse.SERVING
        draining = asyncio.create_task(server.drain())
        await asyncio.sleep(0.2)
        assert not draining.done()  # r1 is still held: Envoy has not reported it
        for name in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            reply = await check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, name
        live = await check(health_pb2.HealthCheckRequest(service="liveness"))
        assert live.status == health_pb2.HealthCheckResponse.SERVING  # draining is not dead
        assert server.completions.end("r1", (200, "10.0.0.1:8000", 0.01, 0.2))  # Envoy's entry comes
        await asyncio.wait_for(draining, timeout=2)
        assert served == [(200, "10.0.0.1:8000", 0.01, 0.2)]  # accounted, not released as lost
    finally:
        channel.close()
        await server.stop()
