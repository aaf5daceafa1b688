"""The gateway's YAML configuration: one validated, immutable object.

Everything the service needs is read from one file and validated up front (unknown keys are
errors, so a typo fails loudly instead of being ignored). ``load_config`` turns a path into a
``GatewayConfig`` or raises ``ConfigError`` whose message names the failing location.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from policies import registry
from policies.base import Decider, Filter, Picker, Scorer
from policies.params import Number


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    """The listening socket and what one client may hold on it (gateway/http/server.py)."""

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_connections: int = Field(10000, ge=0, description="open connections; past it new ones get 503 (0: no cap)")
    head_timeout_s: float = Field(10.0, gt=0, description="a request head (line and headers) must arrive whole "
                                  "within this, from the connection's start or the head's first byte; else 408")
    body_timeout_s: float = Field(60.0, gt=0, description="a request body must arrive whole within this; else 408")
    body_idle_timeout_s: float = Field(15.0, gt=0, description="longest wait for the next bytes of a request "
                                       "body; else 408")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle connection between requests (its last "
                                        "answer written, no byte of a next request) is closed after this")
    shutdown_grace_s: float = Field(25.0, ge=0, description="on SIGTERM, how long requests in flight may finish "
                                    "before they are ended (streams with an error event); then background parts "
                                    "stop within 5 s")
    workers: int = Field(0, ge=0, le=256, description="worker processes serving the port, each a whole gateway "
                         "sharing routing state, admission and /metrics (gateway/cluster/workers.py); 0: one per core "
                         "this process may use")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    gc_young_threshold: int = Field(700, ge=100, description="allocations between young garbage collections "
                                    "(Python's default 700); what is alive after startup and each reload is "
                                    "frozen out of full collections either way (gateway/ops/gcpolicy.py)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, level: Any) -> Any:
        return level.lower() if isinstance(level, str) else level


class ModelConfig(_Strict):
    """One served model. The chat fields mirror the engines' vLLM flags: set them as the engines
    are started, or the gateway's token counts drift from the engines'."""

    name: str = Field(min_length=1, description="the model name clients send")
    tokenizer: str = Field(min_length=1, description="local folder or hub name of the model's tokenizer")
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    max_model_len: int = Field(gt=0, description="context length the engines serve")
    chat_template: str | None = Field(
        None,
        description="vLLM --chat-template: a path to a Jinja chat template, or the template itself "
        "(any value with braces or a newline that is not a readable file)",
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto",
        description="vLLM --chat-template-content-format: whether message content reaches the template as "
        "one string or as a list of parts ('auto' detects it from the template)",
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM --default-chat-template-kwargs: template kwargs every request gets unless its "
        "chat_template_kwargs override them (e.g. {enable_thinking: false})",
    )
    chat_template_kwargs_max_keys: int = Field(
        32, ge=0, description="most keys a request's chat_template_kwargs may have; more get 400 before any work",
    )
    chat_template_kwargs_max_depth: int = Field(
        16, ge=1, description="deepest nesting of objects and lists in a request's chat_template_kwargs (the "
        "object itself is 1); deeper get 400 before any work",
    )
    chat_template_kwargs_max_bytes: int = Field(
        256 * 1024, ge=0, description="largest chat_template_kwargs, counted as its compact JSON text; larger get "
        "400 before any work",
    )
    exclude_tools_when_tool_choice_none: bool = Field(
        False, description="vLLM --exclude-tools-when-tool-choice-none: tool_choice 'none' hides the tools"
    )
    trust_request_chat_template: bool = Field(
        False,
        description="vLLM --trust-request-chat-template: use a request's own chat_template instead of "
        "refusing the request",
    )
    tokenizer_mode: str = Field(
        "auto",
        description="vLLM --tokenizer-mode. Modes with their own chat renderer or tokenizer (mistral, "
        "deepseek_v32, deepseek_v4, kimi_k3, cohere, ...) make the gateway's counts approximate",
    )


def _check_label(key: str, value: str | None = None) -> None:
    """A Kubernetes label key (and value), as the API server would accept it."""
    from gateway.engines.discovery import LABEL_KEY, LABEL_VALUE  # discovery imports this module

    if len(key) > 317 or not LABEL_KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not a Kubernetes label key")
    if value is not None and (len(value) > 63 or not LABEL_VALUE.fullmatch(value)):
        raise ValueError(f"{value!r} (label {key}) is not a Kubernetes label value")


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} must be an http(s) URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"endpoint {url!r} must be a base URL (no path, query or fragment)")
    return url.rstrip("/")


class EndpointConfig(_Strict):
    """One engine. A bare URL string in the YAML means ``{url: URL}``."""

    url: str
    kv_events: str | None = Field(
        None, description="the engine's KV-events publisher (vLLM --kv-events-config endpoint, e.g. "
        "tcp://10.0.0.5:5557): precise prefix routing from what the engine really cached",
    )
    kv_events_replay: str | None = Field(None, description="its replay endpoint, to recover missed events")
    kv_events_topic: str = ""
    topology: dict[str, str] = Field(
        default_factory=dict, max_length=16, description="where the engine runs, as Kubernetes labels (e.g. "
        "topology.kubernetes.io/zone: us-east-1a): pairing policies (same_zone, topology) compare them",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _check_url(url)

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
    a label selector, watched (gateway/engines/discovery.py). They join the pool's static endpoints."""

    label_selector: str = Field(
        min_length=1, description="EndpointSlices to follow, e.g. app.kubernetes.io/component=decode "
        "(a Service's slices carry kubernetes.io/service-name=NAME)",
    )
    namespace: str | None = Field(None, description="their namespace; unset: the gateway's own")
    port: int | str | None = Field(
        None, description="the engine's port: a number, or the name of a port in the slice; unset: the slice's "
        "only port (the first when it has several)",
    )
    scheme: Literal["http", "https"] = "http"
    address_type: Literal["IPv4", "IPv6"] = Field(
        "IPv4", description="the slices' addressType to read: a dual-stack Service has one slice per family "
        "for the same pods, so only one family is followed",
    )
    kv_events_port: int | None = Field(
        None, ge=1, le=65535, description="engines publish KV events on tcp://<address>:<this port>",
    )
    kv_events_replay_port: int | None = Field(None, ge=1, le=65535, description="and replay them on this one")
    kv_events_topic: str = ""
    api_url: str | None = Field(
        None, description="the Kubernetes API; unset: kubeconfig if set, else in-cluster "
        "(KUBERNETES_SERVICE_HOST/_PORT), else $KUBECONFIG",
    )
    kubeconfig: str | None = Field(
        None, description="a kubeconfig file (outside the cluster): its current context's server, CA, token or "
        "client certificate, and namespace",
    )
    token_file: str | None = Field(f"{_SA_DIR}/token", description="bearer token, re-read on each connection")
    ca_file: str | None = Field(
        f"{_SA_DIR}/ca.crt", description="CA bundle of an https API; a file set here must exist (the default, the "
        "service account's, must exist in-cluster)",
    )
    namespace_file: str = f"{_SA_DIR}/namespace"
    watch_timeout_s: int = Field(300, gt=0, description="a watch is renewed (same resourceVersion) this often")
    retry_s: float = Field(1.0, gt=0, description="first wait after a failed list or watch; doubles up to max_retry_s")
    max_retry_s: float = Field(30.0, gt=0)
    max_event_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="longest watch event (one JSON line); a longer one ends the watch "
        "with an error and a fresh list",
    )
    node_labels: list[str] = Field(
        default_factory=list, max_length=8, description="labels of each engine's Node to read into its topology "
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

        _raise("DiscoveryConfig", [_error((field,), getattr(self, field), "discovery_file", message)
                                   for field, message in check_files(self)])
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
        None, description="also find this pool's engines through the Kubernetes API (EndpointSlices)",
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
        return {e.url: tuple(sorted(e.topology.items())) for e in (*self.prefill.endpoints, *self.decode.endpoints)
                if e.topology}


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


Loc = tuple[str | int, ...]


def _error(loc: Loc, value: Any, kind: str, message: str) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(kind, "{msg}", {"msg": message}), loc=loc, input=value)


def _raise(title: str, errors: list[InitErrorDetails]) -> None:
    """Report ``errors`` at their locations (below the model being validated), all at once."""
    if errors:
        raise ValidationError.from_exception_data(title, errors)


class PolicySpec(BaseModel):
    """A policy by registry name plus its own parameters. Name and parameters are checked when the
    config is parsed (against the policy's ``Params``), so each error names its YAML location;
    whether the policy fits its place (filter, scorer, ...) is checked by the pipeline around it."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _known_policy_and_params(self) -> PolicySpec:
        try:
            registry.validate_params(self.name, self.params, also_known=type(self).model_fields)
        except registry.PolicyError as err:  # an unknown name
            _raise("PolicySpec", [_error(("name",), self.name, "unknown_policy", str(err))])
        return self  # a ValidationError from the params goes up as it is: its locations are the keys


class ScorerSpec(PolicySpec):
    weight: Number = Field(1.0, ge=0, description="the scorer's share of the endpoint's total score")


def _fit_errors(loc: Loc, spec: PolicySpec, kind: type) -> list[InitErrorDetails]:
    """Why ``spec``'s policy cannot serve as a ``kind`` at ``loc``. A policy without ``Params`` is
    built to find out (only that can check its parameters)."""
    if why := registry.kind_error(spec.name, kind):
        return [_error((*loc, "name"), spec.name, "policy_kind", why)]
    if registry.params_model(registry.lookup(spec.name)) is None:
        try:
            registry.build(spec.name, spec.params, kind)
        except registry.PolicyError as err:
            return [_error(loc, spec.params, "policy_params", str(err))]
    return []


def _once_each(field: str, specs: Iterable[PolicySpec], kind: type) -> list[InitErrorDetails]:
    """Fit errors of a list of policies, and each repeat of a name: the pipeline's trace (and a
    scorer's weight) are per name, and a repeated filter or scorer only says it louder."""
    errors: list[InitErrorDetails] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        errors += _fit_errors((field, i), spec, kind)
        if spec.name in seen:
            hint = " (give it more weight instead)" if kind is Scorer else ""
            errors.append(_error((field, i, "name"), spec.name, "duplicate_policy",
                                 f"policy {spec.name!r} is already in this list{hint}"))
        seen.add(spec.name)
    return errors


class PoolRoutingConfig(_Strict):
    """How one pool chooses an endpoint: filters, then weighted scorers, then the picker."""

    filters: list[PolicySpec] = Field(default_factory=list)
    scorers: list[ScorerSpec] = Field(default_factory=list)
    picker: PolicySpec = PolicySpec(name="max_score")

    @model_validator(mode="after")
    def _policies_fit(self) -> PoolRoutingConfig:
        _raise("PoolRoutingConfig", [*_once_each("filters", self.filters, Filter),
                                     *_once_each("scorers", self.scorers, Scorer),
                                     *_fit_errors(("picker",), self.picker, Picker)])
        return self


def _default_scorers() -> list[ScorerSpec]:
    return [ScorerSpec(name="prefix_affinity", weight=2.0), ScorerSpec(name="load", weight=1.0)]


class PrefixConfig(_Strict):
    """The prefix index: block hashes of real token ids, as the engines compute them."""

    enabled: bool = True
    block_size: int | None = Field(
        None, gt=0, description="the engines' KV block size; unset: read from their vllm:cache_config_info "
        "(16, vLLM's default, until known)",
    )
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "sha256", description="the engines' --prefix-caching-hash-algo",
    )
    hash_seed: str | None = Field(
        None, description="the engines' PYTHONHASHSEED; needed for hashes equal to the engine's own",
    )
    max_learned_blocks: int = Field(
        200_000, gt=0, description="bound on (endpoint, block) entries learned from routing (~250 bytes each)",
    )
    learned_ttl_s: float = Field(
        600.0, gt=0, description="how long a block learned from routing counts as cached on an engine "
        "without KV events",
    )
    # KV event feeds are unauthenticated ZMQ: what one may make the gateway hold (gateway/engines/kvevents.py)
    max_event_blocks: int = Field(
        262_144, gt=0, description="bound on blocks held per engine from its KV events (~200 bytes each): past "
        "it the engine's oldest stored blocks are forgotten",
    )
    max_event_batch_blocks: int = Field(
        131_072, gt=0, description="block hashes (and events) one KV event batch may carry, all its events "
        "together: a larger batch is refused and the engine's entries are dropped",
    )
    max_event_message_bytes: int = Field(
        8 * 1024 * 1024, ge=64 * 1024, description="longest KV event message (ZMQ_MAXMSGSIZE): ZMQ drops the "
        "connection of a publisher sending a longer one, and the feed reconnects",
    )


class MigrationConfig(_Strict):
    """A decode leg that fails after its first token continues on another decode engine: the
    prompt plus the tokens generated so far, routed like a new request (docs/operations.md,
    "Mid-stream migration")."""

    enabled: bool = Field(True, description="continue an answer whose decode engine failed mid-way on another one")
    max_per_request: int = Field(1, ge=0, le=8, description="migrations one request may use; past them the "
                                 "client gets the error event")
    deadline_s: float = Field(600.0, ge=0, description="a request older than this is not migrated any more "
                              "(0: no limit)")
    non_streaming: bool = Field(True, description="non-streamed requests migrate too: their decode leg streams "
                                "and the gateway assembles the answer (costs gateway CPU per token); false: sent "
                                "as the client sent them, a failure mid-answer is retried from the start")


class RoutingConfig(_Strict):
    decider: PolicySpec = PolicySpec(name="token_threshold")
    decode: PoolRoutingConfig = PoolRoutingConfig(filters=[PolicySpec(name="bounded_load")],
                                                  scorers=_default_scorers())
    prefill: PoolRoutingConfig = PoolRoutingConfig(scorers=_default_scorers())
    prefix: PrefixConfig = PrefixConfig()
    migration: MigrationConfig = MigrationConfig()
    debug_headers: bool = Field(
        False, description="add x-pdgate-route (reason, numbers, chosen endpoints) to every response",
    )

    @field_validator("decider", mode="wrap")
    @classmethod
    def _a_decider_first(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> PolicySpec:
        """A policy of another kind (``name: load``) is said to be one before its parameters are
        judged: they were a decider's, and "unknown parameter of policy 'load'" sends the reader
        to the wrong fix."""
        name = value.get("name") if isinstance(value, dict) else None
        if isinstance(name, str):
            try:
                why = registry.kind_error(name, Decider)
            except registry.PolicyError:  # an unknown name: PolicySpec says so
                why = None
            if why:
                _raise("PolicySpec", [_error(("name",), name, "policy_kind", why)])
        spec: PolicySpec = handler(value)
        return spec

    @model_validator(mode="after")
    def _decider_fits(self) -> RoutingConfig:
        _raise("RoutingConfig", _fit_errors(("decider",), self.decider, Decider))
        return self


class SignalsConfig(_Strict):
    """Engine load scraped from each engine's /metrics."""

    scrape_interval_s: float = Field(1.0, gt=0)
    scrape_timeout_s: float = Field(1.0, gt=0)
    max_age_s: float = Field(5.0, gt=0, description="older scraped values are ignored by routing")


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


class AdmissionConfig(_Strict):
    """Bounds on what the gateway takes on (0: no bound); see gateway/fairness/admission.py."""

    max_in_flight: int = Field(0, ge=0, description="requests in flight through this gateway")
    max_per_decode_endpoint: int = Field(0, ge=0, description="requests in flight on one decode engine")
    max_per_prefill_endpoint: int = Field(0, ge=0, description="prefill legs in flight on one prefill engine")
    max_loop_lag_ms: float = Field(100.0, ge=0, description="new requests get 429 while the worker's event loop "
                                   "runs this late (its measured capacity is used up); 0: never")
    queue_timeout_s: float = Field(5.0, ge=0, description="longest a request waits for capacity before 429")
    retry_after_s: float = Field(1.0, gt=0, description="the Retry-After a 429 carries")


class PlannerSLO(_Strict):
    """The SLO of requests up to ``max_prompt_tokens`` prompt tokens (None: any length)."""

    max_prompt_tokens: int | None = Field(None, ge=1)
    ttft_s: float = Field(gt=0)
    itl_p90_s: float = Field(gt=0)
    itl_p99_s: float = Field(0.1, gt=0, description="with tail: true, each stream's p99 gap")


class PlannerConfig(_Strict):
    """The live planner (sim/planner.py): from the traffic of the last ``window_s``, the engines
    each pool needs to meet the SLOs, published as pdgate_pool_desired_engines{pool} for an
    autoscaler. Off by default; its engine model comes from a simulator profile."""

    enabled: bool = False
    profile: str = Field("llama-3.3-70b-tp8-h100", description="a bundled profile name or a profile file")
    profile_end: Literal["low", "high"] | None = Field(None, description="the profile's uncertain terms at this end")
    window_s: float = Field(300.0, ge=10, le=3600, description="traffic considered")
    interval_s: float = Field(30.0, ge=1, le=600, description="how often the recommendation is recomputed")
    max_requests: int = Field(1000, ge=10, le=5000, description="a larger window is sampled down to this many "
                              "(the model takes ~0.7 s per 1,000 in a thread: this bounds it, and shutdown)")
    target: float = Field(0.9, gt=0, le=1, description="share of requests that must meet their SLO")
    tail: bool = Field(False, description="also hold each stream's p99 gap to itl_p99_s")
    pd_threshold: int | None = Field(None, ge=1, description="prompts from this many tokens go P/D (default: "
                                     "routing's token_threshold, else 4096); ignored without a prefill pool")
    slos: list[PlannerSLO] = Field(
        default_factory=lambda: [
            PlannerSLO(max_prompt_tokens=4095, ttft_s=1.0, itl_p90_s=0.05),
            PlannerSLO(ttft_s=3.0, itl_p90_s=0.05),
        ],
        min_length=1,
        max_length=16,
    )

    @model_validator(mode="after")
    def _checked(self) -> PlannerConfig:
        if self.slos[-1].max_prompt_tokens is not None:
            raise ValueError("planner.slos: the last SLO must cover any length (no max_prompt_tokens)")
        bounds = [s.max_prompt_tokens for s in self.slos[:-1]]
        if any(b is None for b in bounds) or bounds != sorted(set(bounds)):  # type: ignore[type-var]
            raise ValueError("planner.slos: max_prompt_tokens must increase, and only the last SLO may omit it")
        if self.enabled:  # a profile that does not load, or whose engine settings are invalid, fails the config
            from sim import profile  # the simulator package ships with the gateway
            from sim.config import SimConfig

            for end in (None, "low", "high"):
                SimConfig(**profile.engine_settings(self.profile, end=end))
        return self


class LimitsConfig(_Strict):
    """Per-request limits beyond the model's own (0: none)."""

    max_prompt_tokens: int = Field(0, ge=0, description="longer prompts get 400 (the model's context still applies)")
    max_output_tokens: int = Field(
        0, ge=0, description="output tokens one request may ask for in all: its max tokens x its sequences (n or "
        "best_of, x prompts); above it 400, and a request without max tokens gets its share")
    # One request's sequences each hold a decode slot and KV: without caps one client holds an engine.
    max_n: int = Field(16, ge=0, description="`n` above this gets 400 (0: no cap)")
    max_best_of: int = Field(16, ge=0, description="`best_of` above this gets 400 (0: no cap)")
    max_prompts: int = Field(64, ge=0, description="completions: more prompts in one request get 400 (0: no cap)")
    max_header_bytes: int = Field(16384, gt=0, description="request heads (line and headers) over this get 431, "
                                  "counted while they arrive")
    max_headers: int = Field(100, gt=0, description="requests with more headers get 431")


_NAME = r"[A-Za-z0-9._:-]{1,64}"  # tenant and priority class names: also metric label values
_KEY_ATTRS = ("tenant", "weight", "priority", "allow")


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One client API key and what its line says about its requests (all optional):
    ``<key> tenant=acme weight=2 priority=interactive allow=interactive,batch``."""

    key: str
    tenant: str | None = None
    weight: float | None = None
    priority: str | None = None  # the key's default class
    allow: tuple[str, ...] = ()  # classes its x-pdgate-priority header may ask for


def _key_entry(line: str, where: str) -> KeyEntry:
    key, *attrs = line.split()
    fields: dict[str, Any] = {}
    for attr in attrs:
        name, eq, value = attr.partition("=")
        if not eq or name not in _KEY_ATTRS or not value or name in fields:
            raise ValueError(f"{where}: a key's line may add {', '.join(n + '=' for n in _KEY_ATTRS)} once each")
        if name == "weight":
            try:
                fields[name] = float(value)
            except ValueError:
                fields[name] = -1.0
            if not 0 < fields[name] <= 1000:
                raise ValueError(f"{where}: weight must be a number in (0, 1000]")
        elif name == "allow":
            fields[name] = tuple(value.split(","))
        else:
            fields[name] = value
    for value in (fields.get("tenant"), fields.get("priority"), *fields.get("allow", ())):
        if value is not None and (not re.fullmatch(_NAME, value) or value == "other"):
            raise ValueError(f"{where}: tenant and class names are 1-64 of A-Z a-z 0-9 . _ : -, not 'other'")
    return KeyEntry(key, **fields)


def read_file(path: str) -> str:
    """A file the config names, read now (``GatewayConfig.read_text`` prefers the pinned copy)."""
    return Path(path).read_text(encoding="utf-8")


def _not_blank(value: str | None) -> str | None:
    """A secret's file or variable name: unset, or a name. An empty one would read as "no keys" and
    switch authentication off without saying so."""
    if value is not None and not value.strip():
        raise ValueError("is empty: name the file or variable, or remove the key (and say disabled: true to "
                         "switch this off on purpose)")
    return value


class AuthConfig(_Strict):
    """Client API keys (one per line in the file, or comma-separated in the variable); none: open.
    A key's line may name its tenant, weight and priority classes (``KeyEntry``). Turning keys off
    by a reload needs ``disabled: true`` (``access_switched_off``)."""

    api_keys_file: str | None = None
    api_keys_env: str | None = None
    disabled: bool = Field(False, description="serve without API keys on purpose: needed for a reload that "
                           "switches keys off, and for an auth section that names no keys")

    _secret_names = field_validator("api_keys_file", "api_keys_env")(_not_blank)

    @model_validator(mode="after")
    def _one_meaning(self) -> AuthConfig:
        if self.disabled and (self.api_keys_file or self.api_keys_env):
            raise ValueError("disabled: true and API keys at once: remove one")
        return self

    @property
    def configured(self) -> bool:
        """API keys are named (their file or variable), whatever they hold."""
        return bool(self.api_keys_file or self.api_keys_env)

    def api_keys(self, read: Callable[[str], str] = read_file) -> list[str]:
        return [e.key for e in self.key_entries(read)]

    def key_entries(self, read: Callable[[str], str] = read_file) -> list[KeyEntry]:
        """The keys, ``read`` reading the keys file (``GatewayConfig.read_text``: as pinned)."""
        raw: list[str] = []
        if self.api_keys_file:
            try:
                raw += read(self.api_keys_file).splitlines()
            except OSError as err:
                raise ValueError(f"auth.api_keys_file: cannot read ({err.strerror})") from None
        if self.api_keys_env:
            value = os.environ.get(self.api_keys_env)
            if value is None:
                raise ValueError(f"auth.api_keys_env: environment variable {self.api_keys_env} is not set")
            raw += value.split(",")
        keys = [_key_entry(k.strip(), "auth") for k in raw if k.strip() and not k.strip().startswith("#")]
        if (self.api_keys_file or self.api_keys_env) and not keys:
            raise ValueError("auth: API keys are configured but none was found")
        if len({e.key for e in keys}) != len(keys):
            raise ValueError("auth: a key is listed twice")
        return keys


class PriorityClass(_Strict):
    """A class of requests: lower ``priority`` goes first (vLLM's convention, and the value sent
    to engines run with ``--scheduling-policy priority``)."""

    priority: int = Field(0, ge=-1000, le=1000)
    ttft_slo_s: float | None = Field(None, gt=0, le=3600, description="its TTFT objective (None: none)")
    sheddable: bool = Field(False, description="past its objective: 429 at once, instead of waiting")


class TenantConfig(_Strict):
    weight: float = Field(1.0, gt=0, le=1000, description="its share of each pool, relative to the others'")
    priority: str | None = Field(None, description="its default class (else fairness.default_priority)")
    allow: list[str] = Field(default_factory=list, description="classes its x-pdgate-priority header may ask for")


def _default_classes() -> dict[str, PriorityClass]:
    return {"interactive": PriorityClass(priority=-10), "standard": PriorityClass(priority=0),
            "batch": PriorityClass(priority=10, sheddable=True)}


class FairnessConfig(_Strict):
    """Who waits first when the gateway must queue (gateway/fairness/fairqueue.py): by priority class, then
    by each tenant's weighted use of the pool it waits for (prefill tokens sent to the prefill
    pool, decode occupancy on the decode pool), then in arrival order. Off: one FIFO queue."""

    enabled: bool = False
    classes: dict[str, PriorityClass] = Field(default_factory=_default_classes)
    default_priority: str = "standard"
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, description="weights and classes by name")
    tenant_header: str | None = Field("x-pdgate-tenant", description="the tenant's name when API keys are off "
                                      "(None: one tenant, 'default')")
    priority_header: str = "x-pdgate-priority"
    ttft_header: str = Field("x-pdgate-ttft-ms", description="a request's own TTFT objective, milliseconds")
    engine_priority: bool = Field(False, description="send the class's priority to the engines (they must run "
                                  "--scheduling-policy priority: vLLM rejects a non-zero priority otherwise)")
    wait_for_prefill: bool = Field(True, description="a P/D request waits for room in the prefill pool instead "
                                   "of going direct (its long prefill would stall the decode engines' streams)")
    default_output_tokens: int = Field(256, ge=1, description="decode occupancy of a request without max_tokens "
                                       "while it runs (its use is settled to its output at its end)")
    half_life_s: float = Field(10.0, gt=0, le=3600, description="a tenant's use fades by half in this time")
    max_queued: int = Field(1024, ge=1, le=100_000, description="requests waiting per queue (the gateway's "
                            "slots; each engine pool, per model), fairness on or off")
    max_queued_per_tenant: int = Field(256, ge=1, le=100_000, description="one tenant's share of that")
    max_tenants: int = Field(10_000, ge=1, le=1_000_000, description="tenants tracked; others share 'other'")
    metrics_top_tenants: int = Field(20, ge=0, le=1000, description="tenants with their own metric labels")

    @model_validator(mode="after")
    def _names(self) -> FairnessConfig:
        for name in [*self.classes, *self.tenants]:
            if not re.fullmatch(_NAME, name) or name == "other":
                raise ValueError(f"fairness: {name!r} is not a usable name (1-64 of A-Z a-z 0-9 . _ : -, not 'other')")
        if self.default_priority not in self.classes:
            raise ValueError(f"fairness.default_priority: {self.default_priority!r} is not a class")
        for name, t in self.tenants.items():
            for c in [t.priority, *t.allow]:
                if c is not None and c not in self.classes:
                    raise ValueError(f"fairness.tenants.{name}: {c!r} is not a class")
        return self


class AdminConfig(_Strict):
    """GET /admin/config and POST /debug/route: off unless a token is configured. Removing the token
    by a reload needs ``disabled: true`` (``access_switched_off``)."""

    token_env: str | None = Field(None, description="environment variable holding the admin bearer token")
    token_file: str | None = Field(None, description="file holding the admin bearer token")
    protect_metrics: bool = Field(False, description="GET /metrics needs the admin bearer token too (off: open to "
                                  "whoever reaches the port, as Prometheus scrapes by default)")
    tenant_label_secret_env: str | None = Field(
        None, description="environment variable holding a secret (16+ characters) that names each unnamed API "
        "key's tenant key-<HMAC-SHA256 of the key>; unset: key-1, key-2, ... in the keys' order")
    disabled: bool = Field(False, description="admin and debug endpoints off on purpose: needed for a reload "
                           "that removes the token")

    _secret_names = field_validator("token_env", "token_file")(_not_blank)

    @model_validator(mode="after")
    def _metrics_token(self) -> AdminConfig:
        if self.protect_metrics and not (self.token_env or self.token_file):
            raise ValueError("admin.protect_metrics needs admin.token_env or admin.token_file")
        return self

    @model_validator(mode="after")
    def _one_meaning(self) -> AdminConfig:
        if self.disabled and (self.token_env or self.token_file):
            raise ValueError("disabled: true and a token at once: remove one")
        return self

    def token(self, read: Callable[[str], str] = read_file) -> str | None:
        """The admin bearer token, or None: admin and debug endpoints are off."""
        if self.token_file:
            try:
                token = read(self.token_file).strip()
            except OSError as err:
                raise ValueError(f"admin.token_file: cannot read ({err.strerror})") from None
            return token or None
        if self.token_env:
            return os.environ.get(self.token_env, "").strip() or None
        return None


class TimeoutsConfig(_Strict):
    connect_s: float = Field(5.0, gt=0, description="TCP connect to an engine")
    prefill_s: float = Field(600.0, gt=0, description="whole prefill leg")
    decode_first_byte_s: float = Field(
        600.0, gt=0, description="decode leg: until its first token (a direct request prefills there first)",
    )
    decode_idle_s: float = Field(600.0, gt=0, description="wait for the decode leg's next bytes")


class EnginesConfig(_Strict):
    """The engine legs' HTTP client (gateway/engines/transport.py). Applied at startup only: the client and
    its warm connections outlive reloads."""

    transport: Literal["h1", "aiohttp"] = Field(
        "h1", description="h1: the gateway's own HTTP/1.1 client (the cheapest per request); aiohttp: the "
        "reference implementation on aiohttp, same behavior",
    )
    ca_file: str | None = Field(None, description="CA bundle verifying https:// engines; unset: the system's CAs")
    cert_file: str | None = Field(None, description="client certificate (PEM) presented to https:// engines")
    key_file: str | None = Field(None, description="its private key (PEM); unset: in cert_file")

    @model_validator(mode="after")
    def _usable_files(self) -> EnginesConfig:
        """Checked with the config (check-config, reload), not first at startup."""
        if self.key_file and not self.cert_file:
            raise ValueError("key_file is set without cert_file")
        unreadable = [(field, path) for field in ("ca_file", "cert_file", "key_file")
                      if (path := getattr(self, field)) and not (os.path.isfile(path) and os.access(path, os.R_OK))]
        _raise("EnginesConfig", [_error((field,), path, "engines_file", f"{path} is not a readable file")
                                 for field, path in unreadable])
        return self


class FailoverConfig(_Strict):
    """What the gateway does when an engine fails before the client got a byte (never after)."""

    prefill_retries: int = Field(1, ge=0, description="other prefill engines to try after a failed prefill leg")
    fallback_to_direct: bool = Field(True, description="then send the request direct (the decode engine prefills)")
    decode_retries: int = Field(1, ge=0, description="other decode engines to try after a failed decode leg")


class TokenizerConfig(_Strict):
    workers: int = Field(2, ge=1, description="threads that tokenize off the event loop")
    inline_max_bytes: int = Field(
        256, ge=0,  # measured: the largest body whose parse + tokenize stays under ~100 us
        description="request bodies this small are tokenized on the event loop (cheaper than a thread hop); "
        "larger ones on the tokenizer threads",
    )


class TracingConfig(_Strict):
    """OpenTelemetry traces: a span per request with its tokenize, route and engine legs."""

    exporter: Literal["none", "otlp", "console"] = Field(
        "none", description="none: no spans are made; otlp: OTLP/HTTP to `endpoint`; console: print them (local runs)",
    )
    endpoint: str = Field("http://localhost:4318/v1/traces", description="the OTLP/HTTP traces URL")
    headers: dict[str, str] = Field(default_factory=dict, description="extra OTLP request headers")
    headers_env: str | None = Field(
        None, description="environment variable holding more headers as k=v,k2=v2 (keeps credentials out of files)",
    )
    service_name: str = "pdgate"
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces kept; a client's sampled "
                                "traceparent is always followed")


class TelemetryConfig(_Strict):
    """Traces and logs. Applied at startup only (a reload keeps the running exporter)."""

    tracing: TracingConfig = TracingConfig()
    access_log: bool = Field(True, description="one JSON line per request on stdout")


class GatewayConfig(_Strict):
    server: ServerConfig = ServerConfig()
    models: list[ModelConfig] = Field(min_length=1)
    pools: PoolsConfig
    health: HealthConfig = HealthConfig()
    routing: RoutingConfig = RoutingConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    engines: EnginesConfig = EnginesConfig()
    failover: FailoverConfig = FailoverConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    signals: SignalsConfig = SignalsConfig()
    admin: AdminConfig = AdminConfig()
    state: StateConfig = StateConfig()
    admission: AdmissionConfig = AdmissionConfig()
    limits: LimitsConfig = LimitsConfig()
    planner: PlannerConfig = PlannerConfig()
    auth: AuthConfig = AuthConfig()
    fairness: FairnessConfig = FairnessConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    # The files this config names, as read with it (``pin``); None: read them when asked.
    _pinned: PinnedFiles | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _unique_models(self) -> GatewayConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("two models share a name")
        return self

    @model_validator(mode="after")
    def _auth_says_something(self) -> GatewayConfig:
        """``auth: {}`` (a section emptied by an edit, or the last of two ``auth`` keys) is not read
        as "no keys": an auth section names keys or says ``disabled`` (a dumped config says
        ``disabled: false``, and loads as it was)."""
        said = self.auth.configured or "disabled" in self.auth.model_fields_set
        if "auth" in self.model_fields_set and not said:
            _raise("GatewayConfig", [_error(("auth",), {}, "auth_empty", "names no API keys: set api_keys_file "
                                            "or api_keys_env, or disabled: true to serve without keys")])
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def named_files(self) -> dict[str, str]:
        """Where this config names a file whose content is part of its meaning (``{path: where}``):
        the API keys, the admin token, chat templates given as files. A reload reads them with the
        config file, versions them together and applies them together (gateway/config/reload.py)."""
        named: dict[str, str] = {}
        if self.auth.api_keys_file:
            named.setdefault(self.auth.api_keys_file, "auth.api_keys_file")
        if self.admin.token_file:
            named.setdefault(self.admin.token_file, "admin.token_file")
        for i, m in enumerate(self.models):
            if m.chat_template is not None and _names_a_file(m.chat_template):
                named.setdefault(m.chat_template, f"models[{i}].chat_template")
        return named

    @property
    def pinned(self) -> PinnedFiles | None:
        return self._pinned

    def pin(self, files: PinnedFiles) -> GatewayConfig:
        """This config, its named files read from ``files`` from now on (never from disk again):
        what it means stays what was validated, however the files change, until a reload."""
        pinned = self.model_copy()
        pinned._pinned = files
        return pinned

    def read_text(self, path: str) -> str:
        """A file this config names: its pinned content, else read now. Raises OSError as reading would."""
        if self._pinned is not None and (text := self._pinned.text(path)) is not None:
            return text
        return read_file(path)

    def key_entries(self) -> list[KeyEntry]:
        """The client API keys (``AuthConfig.key_entries``), from the pinned keys file."""
        return self.auth.key_entries(self.read_text)

    def admin_token(self) -> str | None:
        """The admin bearer token (``AdminConfig.token``), from the pinned token file."""
        return self.admin.token(self.read_text)

    def tokenizer_model(self, m: ModelConfig) -> ModelConfig:
        """``m`` as its tokenizer is to be loaded: a chat template file given as its pinned text
        (the tokenizer takes a value with braces or a newline as the template itself)."""
        if self._pinned is None or m.chat_template is None or m.chat_template not in self._pinned.files:
            return m
        try:
            text = self.read_text(m.chat_template)
        except OSError as err:  # as gateway/tokenization/tokenizer.py says it when it reads the file
            raise ValueError(f"chat_template {m.chat_template!r} looks like a file path, but it cannot be read: "
                             f"{err}") from None
        if not any(c in text for c in "{}\n"):  # not a template the tokenizer would take inline: let it read
            return m
        return m.model_copy(update={"chat_template": text})


def _names_a_file(template: str) -> bool:
    """As gateway/tokenization/tokenizer.py's load_template reads ``chat_template``: a file when one is there,
    else the template itself when it looks like one (braces or a newline), else a missing file."""
    return os.path.isfile(template) or not any(c in template for c in "{}\n")


@dataclass(frozen=True)
class PinnedFiles:
    """The files a config names (``GatewayConfig.named_files``) as read together with it: their
    bytes, or why they could not be read (errno, message), by path."""

    files: dict[str, bytes | tuple[int, str]]

    @classmethod
    def read(cls, paths: Iterable[str]) -> PinnedFiles:
        files: dict[str, bytes | tuple[int, str]] = {}
        for path in paths:
            try:
                files[path] = Path(path).read_bytes()
            except OSError as err:
                files[path] = (err.errno or 0, err.strerror or type(err).__name__)
        return cls(files)

    def text(self, path: str) -> str | None:
        """The pinned file's text (None: not pinned); raises the OSError reading it raised."""
        if path not in self.files:
            return None
        content = self.files[path]
        if isinstance(content, tuple):
            raise OSError(*content)
        return content.decode("utf-8")

    def digest_input(self) -> bytes:
        """What a config version hashes besides the config file's bytes (gateway/config/reload.py)."""
        out = b""
        for path in sorted(self.files):
            content = self.files[path]
            body = content if isinstance(content, bytes) else f"unreadable {content[0]}".encode()
            out += b"\0%s\0%d\0%s" % (path.encode(), len(body), body)
        return out


def access_switched_off(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """What going from ``old`` (the config running) to ``new`` switches off: client API keys, the
    admin token; each a phrase naming where it came from. Such a change must be said on purpose in
    ``new`` (``auth.disabled``, ``admin.disabled``): an edit that drops a section, or empties it,
    never opens the gateway by accident. Raises ValueError for what is switched off unsaid."""
    off: list[tuple[str, bool]] = []
    if old.auth.configured and not new.auth.configured:  # (configured keys that hold none do not load)
        source = _source(old.auth.api_keys_file, "auth.api_keys_file", old.auth.api_keys_env, "auth.api_keys_env")
        off.append((f"API keys (from {source})", new.auth.disabled))
    try:
        had_token = old.admin_token() is not None
    except ValueError:  # its file gone since: it cannot be what is running
        had_token = bool(old.admin.token_file or old.admin.token_env)
    if had_token and new.admin_token() is None:
        source = _source(old.admin.token_file, "admin.token_file", old.admin.token_env, "admin.token_env")
        off.append((f"the admin token (from {source})", new.admin.disabled))
    unsaid = [what for what, said in off if not said]
    if unsaid:
        flags = [flag for what, flag in (("API keys", "auth.disabled: true"), ("admin token", "admin.disabled: true"))
                 if any(what in u for u in unsaid)]
        raise ValueError(f"this change switches off {' and '.join(unsaid)}; to do that on purpose, the new config "
                         f"must say {' and '.join(flags)}")
    return [what for what, _ in off]


def _source(file: str | None, file_key: str, env: str | None, env_key: str) -> str:
    """Where a secret came from, for a log line: the file or variable's name, never its content."""
    return f"{file_key} {file!r}" if file else f"{env_key} {env!r}"


class ConfigError(ValueError):
    """A config file that cannot be used; the message says where and why."""


def _render_loc(loc: Iterable[str | int]) -> str:
    """``routing.decode.scorers[1].weight``: list indexes as in the YAML's paths, not as keys."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config model a field holds (in a list, a mapping, an optional), and whether it sits
    under a mapping's keys (names the YAML chose: the next part of a location is one)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation)
    if get_origin(annotation) is dict and len(args) == 2:
        return _model_in(args[1])[0], True
    for arg in args:
        model, keyed = _model_in(arg)
        if model is not None:
            return model, keyed
    return None, False


def _keys_at(loc: Loc) -> list[str]:
    """The keys the mapping at ``loc`` takes (none known: a policy's parameters, a free mapping)."""
    model: type[BaseModel] | None = GatewayConfig
    keyed = False
    for part in loc:
        if keyed or isinstance(part, int):  # a mapping's own key, a list's item: the same model below
            keyed = False
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return []
        model, keyed = _model_in(field.annotation)
    return list(model.model_fields) if model is not None else []


def _unknown_key(loc: Loc) -> str:
    """An unknown key, with the known one it is closest to (``sever`` -> ``server``)."""
    known = _keys_at(loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (known: {', '.join(sorted(known))})" if known else "unknown key"


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        msg = _unknown_key(e["loc"]) if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        lines.append(f"  {_render_loc(e['loc'])}: {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> GatewayConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err)) from None


def load_config(path: str | Path, text: str | None = None) -> GatewayConfig:
    """Parse and validate ``path`` (or ``text``, its content already read)."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader (below)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        kind = ":" if isinstance(err, DuplicateKeyError) else " YAML syntax error:"
        raise ConfigError(f"{path}:{where}{kind} {getattr(err, 'problem', err)}") from None
    return parse_config(data, str(path))


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping with the same key twice."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping, at any depth. YAML leaves
    it to the loader and PyYAML keeps the last: a second ``auth: {}`` below the real one would
    silently switch API keys off. Merge keys (``<<: *base``) still override what they merge."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Iterator[dict[Any, Any]]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: the safe loader refuses it itself
            continue
        if first is not key_node:
            raise DuplicateKeyError(
                None, None, f"key {key!r} appears twice in one mapping (first at line {first.start_mark.line + 1}); "
                "YAML would keep only the last", key_node.start_mark)
    yield from loader.construct_yaml_map(node)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
