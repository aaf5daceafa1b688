"""The engine pools: endpoints (static, or found through Kubernetes discovery), their health
checks and outlier ejection."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from gateway.config.fields import _check_label, _error, _raise, _Strict, check_url


class EndpointConfig(_Strict):
    """One engine. A bare URL string in the YAML means ``{url: URL}``."""

    url: str
    kv_events: str | None = Field(
        None,
        description="the engine's KV-events publisher (vLLM --kv-events-config endpoint, e.g. "
        "tcp://10.0.0.5:5557): precise prefix routing from what the engine really cached",
    )
    kv_events_replay: str | None = Field(None, description="its replay endpoint, to recover missed events")
    kv_events_topic: str = ""
    topology: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="where the engine runs, as Kubernetes labels (e.g. "
        "topology.kubernetes.io/zone: us-east-1a): pairing policies (same_zone, topology) compare them",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return check_url(url)

    @field_validator("topology")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            _check_label(key, value)
        return labels

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq(cls, addr: str | None) -> str | None:
        if addr is not None and not addr.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{addr!r} must be a ZMQ address (tcp://host:port or ipc://path)")
        return addr


_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoveryConfig(_Strict):
    """Engines found through the Kubernetes API: the ready endpoints of the EndpointSlices matching
    a label selector, watched (gateway/engines/discovery/). They join the pool's static endpoints."""

    label_selector: str = Field(
        min_length=1,
        description="EndpointSlices to follow, e.g. app.kubernetes.io/component=decode "
        "(a Service's slices carry kubernetes.io/service-name=NAME)",
    )
    namespace: str | None = Field(None, description="their namespace; unset: the gateway's own")
    port: int | str | None = Field(
        None,
        description="the engine's port: a number, or the name of a port in the slice; unset: the slice's "
        "only port (the first when it has several)",
    )
    scheme: Literal["http", "https"] = "http"
    address_type: Literal["IPv4", "IPv6"] = Field(
        "IPv4",
        description="the slices' addressType to read: a dual-stack Service has one slice per family "
        "for the same pods, so only one family is followed",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="engines publish KV events on tcp://<address>:<this port>",
    )
    kv_events_replay_port: int | None = Field(None, ge=1, le=65535, description="and replay them on this one")
    kv_events_topic: str = ""
    api_url: str | None = Field(
        None,
        description="the Kubernetes API; unset: kubeconfig if set, else in-cluster "
        "(KUBERNETES_SERVICE_HOST/_PORT), else $KUBECONFIG",
    )
    kubeconfig: str | None = Field(
        None,
        description="a kubeconfig file (outside the cluster): its current context's server, CA, token, "
        "client certificate or exec credentials (EKS: aws eks get-token), and namespace",
    )
    token_file: str | None = Field(f"{_SA_DIR}/token", description="bearer token, re-read on each connection")
    ca_file: str | None = Field(
        f"{_SA_DIR}/ca.crt",
        description="CA bundle of an https API; a file set here must exist (the default, the "
        "service account's, must exist in-cluster)",
    )
    namespace_file: str = f"{_SA_DIR}/namespace"
    watch_timeout_s: int = Field(300, gt=0, description="a watch is renewed (same resourceVersion) this often")
    retry_s: float = Field(1.0, gt=0, description="first wait after a failed list or watch; doubles up to max_retry_s")
    max_retry_s: float = Field(30.0, gt=0)
    max_event_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="longest watch event (one JSON line); a longer one ends the watch with an error and a fresh list",
    )
    node_labels: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="labels of each engine's Node to read into its topology "
        "(e.g. topology.k8s.aws/network-node-layer-3, an EC2 network spine); needs get on nodes. The slice's zone "
        "is always read",
    )

    @field_validator("node_labels")
    @classmethod
    def _node_labels(cls, keys: list[str]) -> list[str]:
        for key in keys:
            _check_label(key)
        if len(set(keys)) != len(keys):
            raise ValueError("a label is listed twice")
        return keys

    @field_validator("label_selector")
    @classmethod
    def _selector(cls, text: str) -> str:
        from gateway.engines.discovery import LabelSelector  # discovery imports this module

        LabelSelector.parse(text)  # the watcher checks slices against it too
        return text

    @model_validator(mode="after")
    def _files_exist(self) -> DiscoveryConfig:
        """Files the config names (ca_file other than the service account's, kubeconfig) must be
        usable here; what the environment decides (in-cluster, $KUBECONFIG) is checked by the
        watcher when it starts, so a config can be checked away from its cluster."""
        from gateway.engines.discovery import check_files

        _raise(
            "DiscoveryConfig",
            [_error((field,), getattr(self, field), "discovery_file", message) for field, message in check_files(self)],
        )
        return self

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, url: str | None) -> str | None:
        if url is not None and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise ValueError(f"api_url {url!r} must be an http(s) URL with a host")
        return url.rstrip("/") if url else url

    @field_validator("port")
    @classmethod
    def _port(cls, port: int | str | None) -> int | str | None:
        if isinstance(port, str) and port.isdigit():
            port = int(port)
        if isinstance(port, int) and not 1 <= port <= 65535:
            raise ValueError(f"port {port} is not in 1..65535")
        if isinstance(port, str) and not port:
            raise ValueError("port name is empty")
        return port


class PoolConfig(_Strict):
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig | None = Field(
        None,
        description="also find this pool's engines through the Kubernetes API (EndpointSlices)",
    )

    @field_validator("endpoints", mode="before")
    @classmethod
    def _bare_urls(cls, items: Any) -> Any:
        if isinstance(items, list):
            return [{"url": i} if isinstance(i, str) else i for i in items]
        return items

    @field_validator("endpoints")
    @classmethod
    def _unique(cls, eps: list[EndpointConfig]) -> list[EndpointConfig]:
        urls = [e.url for e in eps]
        if len(set(urls)) != len(urls):
            raise ValueError("an endpoint is listed twice")
        return eps

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]


class PoolsConfig(_Strict):
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig

    @field_validator("decode")
    @classmethod
    def _decode_needed(cls, decode: PoolConfig) -> PoolConfig:
        if not decode.endpoints and decode.discovery is None:
            raise ValueError("needs at least one endpoint or discovery (every request ends on a decode engine)")
        return decode

    @property
    def topology(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """Each endpoint's topology labels (those that have any), by URL, sorted by key."""
        return {
            e.url: tuple(sorted(e.topology.items()))
            for e in (*self.prefill.endpoints, *self.decode.endpoints)
            if e.topology
        }


class OutlierConfig(_Strict):
    """Passive health: an endpoint whose requests fail is ejected for a while, then tried again
    with real traffic (ejection times double while it keeps failing)."""

    consecutive_failures: int = Field(3, ge=1, description="failed requests in a row that eject an endpoint")
    error_rate: float = Field(0.5, gt=0, le=1, description="share of failed requests in the window that ejects")
    window: int = Field(20, ge=1, description="the last requests the error rate is computed over")
    min_requests: int = Field(10, ge=1, description="requests in the window before the error rate counts")
    base_ejection_s: float = Field(5.0, gt=0)
    max_ejection_s: float = Field(60.0, gt=0)


class HealthConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    path: str = "/health"
    failures_to_mark_down: int = Field(2, ge=1, description="consecutive failed probes before an endpoint is skipped")
    outlier: OutlierConfig = OutlierConfig()
