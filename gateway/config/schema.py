"""The whole config: ``GatewayConfig`` and the sections that have no module of their own, the
files it names (pinned as read with it), and what a change of it may switch off."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from gateway.config.access import AdminConfig, AuthConfig, FairnessConfig, KeyEntry
from gateway.config.fields import _error, _raise, _Strict, read_file
from gateway.config.pools import HealthConfig, PoolsConfig
from gateway.config.process import EnginesConfig, EppConfig, ServerConfig, StateConfig, TelemetryConfig
from gateway.config.routing import RoutingConfig, SignalsConfig

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"  # what an engine accepts as a model name, bounded


class AdapterConfig(_Strict):
    """A LoRA adapter of a base model, served under its own name (vLLM ``--lora-modules name=path``)."""

    name: str = Field(pattern=ADAPTER_NAME, description="the model name clients send for this adapter")
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="where the engines load it from, exactly as they are given it (vLLM hashes this "
        "string into the adapter's KV blocks: /a/b and /a/b/ are different adapters)",
    )
    max_rank: int | None = Field(None, gt=0, description="its LoRA rank (engines need --max-lora-rank at least this)")


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
        32,
        ge=0,
        description="most keys a request's chat_template_kwargs may have; more get 400 before any work",
    )
    chat_template_kwargs_max_depth: int = Field(
        16,
        ge=1,
        description="deepest nesting of objects and lists in a request's chat_template_kwargs (the "
        "object itself is 1); deeper get 400 before any work",
    )
    chat_template_kwargs_max_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="largest chat_template_kwargs, counted as its compact JSON text; larger get 400 before any work",
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
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        max_length=1024,
        description="LoRA adapters of this model, each served under its own name with this model's "
        "tokenizer and template (more are discovered from the engines' /v1/models)",
    )


class LoraConfig(_Strict):
    """LoRA adapters across the engines (docs/adapters.md): which engine holds which adapter comes
    from their /v1/models, refreshed on an interval; with ``dynamic_loading`` the gateway loads an
    adapter on the engines it picks when none holds it (vLLM's /v1/load_lora_adapter, which needs
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 on the engines)."""

    discover: bool = Field(
        True, description="serve adapters the engines list in /v1/models (parent: a configured model)"
    )
    refresh_s: float = Field(10.0, gt=0, le=3600, description="how often each engine's adapters are read again")
    dynamic_loading: bool = Field(False, description="load a configured adapter on the engines routing picks")
    load_timeout_s: float = Field(60.0, gt=0, le=600, description="longest a request waits for an adapter load")
    max_adapters_per_engine: int = Field(
        0,
        ge=0,
        description="with dynamic loading: adapters the gateway keeps loaded on one engine; loading one more "
        "unloads the least recently used one it loaded (0: no bound)",
    )
    unload_idle_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="an adapter a request was routed with this recently is not unloaded for room (the "
        "request may not have reached the engine yet)",
    )


class AdmissionConfig(_Strict):
    """Bounds on what the gateway takes on (0: no bound); see gateway/fairness/admission.py."""

    max_in_flight: int = Field(0, ge=0, description="requests in flight through this gateway")
    max_per_decode_endpoint: int = Field(0, ge=0, description="requests in flight on one decode engine")
    max_per_prefill_endpoint: int = Field(0, ge=0, description="prefill legs in flight on one prefill engine")
    max_loop_lag_ms: float = Field(
        100.0,
        ge=0,
        description="new requests get 429 while the worker's event loop "
        "runs this late (its measured capacity is used up); 0: never",
    )
    overload_hold_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="the loop must run later than max_loop_lag_ms for this long before new requests get "
        "429 (a burst the gateway absorbs is served; five times the bound late is shed at once)",
    )
    queue_timeout_s: float = Field(5.0, ge=0, description="longest a request waits for capacity before 429")
    retry_after_s: float = Field(1.0, gt=0, description="the Retry-After a 429 carries")


class PlannerSLO(_Strict):
    """The SLO of requests up to ``max_prompt_tokens`` prompt tokens (None: any length)."""

    max_prompt_tokens: int | None = Field(None, ge=1)
    ttft_s: float = Field(gt=0)
    itl_p90_s: float = Field(gt=0)
    itl_p99_s: float = Field(0.1, gt=0, description="with tail: true, each stream's p99 gap")


class PlannerConfig(_Strict):
    """The live planner (engine_model/planner.py): from the traffic of the last ``window_s``, the engines
    each pool needs to meet the SLOs, published as pdgate_pool_desired_engines{pool} for an
    autoscaler. Off by default; its engine model comes from a simulator profile."""

    enabled: bool = False
    profile: str = Field("llama-3.3-70b-tp8-h100", description="a bundled profile name or a profile file")
    profile_end: Literal["low", "high"] | None = Field(None, description="the profile's uncertain terms at this end")
    window_s: float = Field(300.0, ge=10, le=3600, description="traffic considered")
    interval_s: float = Field(30.0, ge=1, le=600, description="how often the recommendation is recomputed")
    max_requests: int = Field(
        1000,
        ge=10,
        le=5000,
        description="a larger window is sampled down to this many "
        "(the model takes ~0.7 s per 1,000 in a thread: this bounds it, and shutdown)",
    )
    target: float = Field(0.9, gt=0, le=1, description="share of requests that must meet their SLO")
    tail: bool = Field(False, description="also hold each stream's p99 gap to itl_p99_s")
    pd_threshold: int | None = Field(
        None,
        ge=1,
        description="prompts from this many tokens go P/D (default: "
        "routing's token_threshold, else 4096); ignored without a prefill pool",
    )
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
            from engine_model import profile  # the engine model the planner runs (a shared package)
            from engine_model.config import SimConfig

            for end in (None, "low", "high"):
                SimConfig(**profile.engine_settings(self.profile, end=end))
        return self


class LimitsConfig(_Strict):
    """Per-request limits beyond the model's own (0: none)."""

    max_prompt_tokens: int = Field(0, ge=0, description="longer prompts get 400 (the model's context still applies)")
    max_output_tokens: int = Field(
        0,
        ge=0,
        description="output tokens one request may ask for in all: its max tokens x its sequences (n or "
        "best_of, x prompts); above it 400, and a request without max tokens gets its share",
    )
    # One request's sequences each hold a decode slot and KV: without caps one client holds an engine.
    max_n: int = Field(16, ge=0, description="`n` above this gets 400 (0: no cap)")
    max_best_of: int = Field(16, ge=0, description="`best_of` above this gets 400 (0: no cap)")
    max_prompts: int = Field(64, ge=0, description="completions: more prompts in one request get 400 (0: no cap)")
    max_header_bytes: int = Field(
        16384, gt=0, description="request heads (line and headers) over this get 431, counted while they arrive"
    )
    max_headers: int = Field(100, gt=0, description="requests with more headers get 431")


class TimeoutsConfig(_Strict):
    connect_s: float = Field(5.0, gt=0, description="TCP connect to an engine")
    prefill_s: float = Field(600.0, gt=0, description="whole prefill leg")
    decode_first_byte_s: float = Field(
        600.0,
        gt=0,
        description="decode leg: until its first token (a direct request prefills there first)",
    )
    decode_idle_s: float = Field(600.0, gt=0, description="wait for the decode leg's next bytes")


class FailoverConfig(_Strict):
    """What the gateway does when an engine fails before the client got a byte (never after)."""

    prefill_retries: int = Field(1, ge=0, description="other prefill engines to try after a failed prefill leg")
    fallback_to_direct: bool = Field(True, description="then send the request direct (the decode engine prefills)")
    decode_retries: int = Field(1, ge=0, description="other decode engines to try after a failed decode leg")


class TokenizerConfig(_Strict):
    workers: int = Field(2, ge=1, description="threads that tokenize off the event loop")
    inline_max_bytes: int = Field(
        4096,
        # measured (docs/benchmarks.md "Tokenizing inline"): a hop to a tokenizer thread costs the worker
        # ~250 us of CPU in GIL hand-offs, more than tokenizing 2 KB in place; 4 KiB holds the loop <= ~0.5 ms
        ge=0,
        description="request bodies this small are tokenized on the event loop (cheaper than a thread hop); "
        "larger ones on the tokenizer threads",
    )


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
    lora: LoraConfig = LoraConfig()
    epp: EppConfig = EppConfig()

    # The files this config names, as read with it (``pin``); None: read them when asked.
    _pinned: PinnedFiles | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _unique_models(self) -> GatewayConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("two models share a name")
        adapters = [a.name for m in self.models for a in m.adapters]
        if clash := sorted(set(adapters) & set(names)):
            raise ValueError(f"adapter {clash[0]} has the name of a model")
        if len(set(adapters)) != len(adapters):
            raise ValueError("two adapters share a name")
        return self

    @model_validator(mode="after")
    def _auth_says_something(self) -> GatewayConfig:
        """``auth: {}`` (a section emptied by an edit, or the last of two ``auth`` keys) is not read
        as "no keys": an auth section names keys or says ``disabled`` (a dumped config says
        ``disabled: false``, and loads as it was)."""
        said = self.auth.configured or "disabled" in self.auth.model_fields_set
        if "auth" in self.model_fields_set and not said:
            _raise(
                "GatewayConfig",
                [
                    _error(
                        ("auth",),
                        {},
                        "auth_empty",
                        "names no API keys: set api_keys_file or api_keys_env, or disabled: true to serve without keys",
                    )
                ],
            )
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
            raise ValueError(
                f"chat_template {m.chat_template!r} looks like a file path, but it cannot be read: {err}"
            ) from None
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
        flags = [
            flag
            for what, flag in (("API keys", "auth.disabled: true"), ("admin token", "admin.disabled: true"))
            if any(what in u for u in unsaid)
        ]
        raise ValueError(
            f"this change switches off {' and '.join(unsaid)}; to do that on purpose, the new config "
            f"must say {' and '.join(flags)}"
        )
    return [what for what, _ in off]


def _source(file: str | None, file_key: str, env: str | None, env_key: str) -> str:
    """Where a secret came from, for a log line: the file or variable's name, never its content."""
    return f"{file_key} {file!r}" if file else f"{env_key} {env!r}"
