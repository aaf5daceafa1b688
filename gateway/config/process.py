"""The sections bound to the process: its listening socket, the engine legs' HTTP client, the
shared-state connection, the telemetry exporters and the endpoint picker's listener. A reload
keeps their running values and says so (``gateway/http/reconfigure.py``'s ``RESTART_ONLY``)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.fields import _error, _raise, _Strict


class ServerConfig(_Strict):
    """The listening socket and what one client may hold on it (gateway/http/server.py)."""

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_connections: int = Field(10000, ge=0, description="open connections; past it new ones get 503 (0: no cap)")
    head_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request head (line and headers) must arrive whole "
        "within this, from the connection's start or the head's first byte; else 408",
    )
    body_timeout_s: float = Field(60.0, gt=0, description="a request body must arrive whole within this; else 408")
    body_idle_timeout_s: float = Field(
        15.0, gt=0, description="longest wait for the next bytes of a request body; else 408"
    )
    client_stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a client that takes none of the bytes waiting for it this long (its send buffer "
        "full, or its close waiting on them) is disconnected, and its engine request aborted",
    )
    keep_alive_timeout_s: float = Field(
        5.0,
        gt=0,
        description="an idle connection between requests (its last "
        "answer written, no byte of a next request) is closed after this",
    )
    shutdown_grace_s: float = Field(
        25.0,
        ge=0,
        description="on SIGTERM, how long requests in flight may finish "
        "before they are ended (streams with an error event); then background parts "
        "stop within 5 s",
    )
    workers: int = Field(
        0,
        ge=0,
        le=256,
        description="worker processes serving the port, each a whole gateway "
        "sharing routing state, admission and /metrics (gateway/cluster/workers.py); 0: one per core "
        "this process may use",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    gc_young_threshold: int = Field(
        700,
        ge=100,
        description="allocations between young garbage collections "
        "(Python's default 700); what is alive after startup and each reload is "
        "frozen out of full collections either way (gateway/ops/gcpolicy.py)",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, level: Any) -> Any:
        return level.lower() if isinstance(level, str) else level


class StateConfig(_Strict):
    """Where routing state lives: in this process, or shared by several replicas through Redis."""

    backend: Literal["memory", "redis"] = "memory"
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL (without a password: use url_env)")
    url_env: str | None = Field(None, description="environment variable holding the Redis URL (wins over url)")
    key_prefix: str = Field("pdgate", min_length=1, description="namespace of every key this gateway writes")
    timeout_s: float = Field(0.05, gt=0, description="longest a request waits for Redis before routing on local state")
    sync_interval_s: float = Field(0.5, gt=0, description="how often replicas exchange in-flight counts")
    retry_s: float = Field(2.0, gt=0, description="after a Redis failure, local state only for this long")

    def redis_url(self) -> str:
        if self.url_env:
            value = os.environ.get(self.url_env)
            if not value:
                raise ValueError(f"state.url_env: environment variable {self.url_env} is not set")
            return value
        return self.url


class EnginesConfig(_Strict):
    """The engine legs' HTTP client (gateway/engines/transport.py). Applied at startup only: the client and
    its warm connections outlive reloads."""

    transport: Literal["h1", "aiohttp"] = Field(
        "h1",
        description="h1: the gateway's own HTTP/1.1 client (the cheapest per request); aiohttp: the "
        "reference implementation on aiohttp, same behavior",
    )
    splice: bool = Field(
        True,
        description="a stream's chunks go from the engine's connection straight onto the "
        "client's (no wake-up of the request per chunk: gateway/http/splice.py); false: chunk by chunk "
        "through ASGI (for ruling the splice out)",
    )
    ca_file: str | None = Field(None, description="CA bundle verifying https:// engines; unset: the system's CAs")
    cert_file: str | None = Field(None, description="client certificate (PEM) presented to https:// engines")
    key_file: str | None = Field(None, description="its private key (PEM); unset: in cert_file")

    @model_validator(mode="after")
    def _usable_files(self) -> EnginesConfig:
        """Checked with the config (check-config, reload), not first at startup."""
        if self.key_file and not self.cert_file:
            raise ValueError("key_file is set without cert_file")
        unreadable = [
            (field, path)
            for field in ("ca_file", "cert_file", "key_file")
            if (path := getattr(self, field)) and not (os.path.isfile(path) and os.access(path, os.R_OK))
        ]
        _raise(
            "EnginesConfig",
            [_error((field,), path, "engines_file", f"{path} is not a readable file") for field, path in unreadable],
        )
        return self


class TracingConfig(_Strict):
    """OpenTelemetry traces: a span per request with its tokenize, route and engine legs."""

    exporter: Literal["none", "otlp", "console"] = Field(
        "none",
        description="none: no spans are made; otlp: OTLP/HTTP to `endpoint`; console: print them (local runs)",
    )
    endpoint: str = Field("http://localhost:4318/v1/traces", description="the OTLP/HTTP traces URL")
    headers: dict[str, str] = Field(default_factory=dict, description="extra OTLP request headers")
    headers_env: str | None = Field(
        None,
        description="environment variable holding more headers as k=v,k2=v2 (keeps credentials out of files)",
    )
    service_name: str = "pdgate"
    sample_ratio: float = Field(
        1.0, ge=0, le=1, description="share of new traces kept; a client's sampled traceparent is always followed"
    )


class TelemetryConfig(_Strict):
    """Traces and logs. Applied at startup only (a reload keeps the running exporter)."""

    tracing: TracingConfig = TracingConfig()
    access_log: bool = Field(True, description="one JSON line per request on stdout")


class EppConfig(_Strict):
    """pdgate as an endpoint picker behind Envoy (``pdgate epp``, docs/epp.md): Envoy asks over
    ext_proc which engine serves each request and relays the bytes itself. Read at startup: a
    change of ``port`` or ``host`` takes a restart."""

    enabled: bool = Field(False, description="serve the ext_proc endpoint picker (`pdgate epp` sets it)")
    host: str = "0.0.0.0"
    port: int = Field(9002, ge=0, le=65535, description="the picker's gRPC port (ext_proc, access log, health)")
    fallbacks: int = Field(
        2,
        ge=0,
        le=8,
        description="decode endpoints after the chosen one, in order, that Envoy may retry (override_host)",
    )
    prefill: Literal["picker", "header"] = Field(
        "picker",
        description="picker: on the P/D path the picker runs the prefill leg and puts its KV handle in the "
        "body; header: it only names the prefill engine in x-prefiller-host-port (llm-d's decode sidecar)",
    )
    close_after_answer: bool = Field(
        True,
        description="close each ext_proc stream once the picker has answered (Envoy then skips the "
        "filter for the rest of the request); false keeps it open and passes the response phase through "
        "unchanged, for a data plane that fails on a clean close (agentgateway, its issue 3436)",
    )
    completion_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="a routed request's admission slot and engine count wait this long for Envoy's access "
        "log entry; then they are released and the request counted as unconfirmed",
    )
